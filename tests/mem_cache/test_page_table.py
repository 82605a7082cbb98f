import torch

from edserve.mem_cache import page_table_from_req_to_token


def test_page_table_is_strided_columns_over_page_size():
    r2t = torch.tensor(
        [[0] * 8, [8, 9, 10, 11, 20, 21, 0, 0], [4, 5, 6, 7, 12, 13, 14, 15]], dtype=torch.int32
    )
    pt = page_table_from_req_to_token(r2t, 4)
    assert pt.dtype == torch.int32
    assert pt.tolist() == [[0, 0], [2, 5], [1, 3]]
    assert page_table_from_req_to_token(r2t, 4, rows=torch.tensor([2, 1])).tolist() == [
        [1, 3],
        [2, 5],
    ]
    assert page_table_from_req_to_token(r2t, 4, num_pages=1).tolist() == [[0], [2], [1]]
    padded = page_table_from_req_to_token(r2t, 4, rows=torch.tensor([1]), num_pages=4)
    assert padded.tolist() == [[2, 5, 0, 0]]
    assert torch.equal(page_table_from_req_to_token(r2t, 1), r2t)


def test_page_table_maps_every_token_to_its_slot():
    ps = 4
    slots = torch.tensor([8, 9, 10, 11, 20, 21, 22])  # positions 0..6
    r2t = torch.zeros((2, 8), dtype=torch.int32)
    r2t[1, :7] = slots.int()
    pt = page_table_from_req_to_token(r2t, ps, rows=torch.tensor([1]))[0]
    pos = torch.arange(7)
    assert torch.equal(pt[pos // ps].long() * ps + pos % ps, slots)
