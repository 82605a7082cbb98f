"""The scheduler without a model: schedule() -> made-up tokens -> update(), with exact rows,
slots, finishes and frees (page size 4, a 6-token "encoder")."""

from __future__ import annotations

import torch

from edserve.engine.batch_builder import Pools
from edserve.engine.req import Req
from edserve.engine.request import FinishReason, GenerateRequest, SamplingParams
from edserve.engine.scheduler import Scheduler, SchedulerLimits
from edserve.engine.step import StepOutput
from edserve.layers.attention import create_backend
from edserve.layers.forward_batch import ForwardMode
from edserve.mem_cache import KVPool, PagedTokenToKVPoolAllocator, ReqToTokenPool

PS, ENC, EOS = 4, 6, 99


def _pools(slots: int = 64, rows: int = 4) -> Pools:
    dev = torch.device("cpu")
    return Pools(ReqToTokenPool(rows, 40, dev), PagedTokenToKVPoolAllocator(slots, PS, dev),
                 KVPool(slots, PS, 1, 1, 4, torch.float32, dev), create_backend("flat", PS), dev)


def _req(max_new: int, prompt=(1, 2), finished: list | None = None) -> Req:
    request = GenerateRequest(list(prompt), None, SamplingParams(max_new_tokens=max_new))
    reserved = -(-(ENC + len(prompt) + max_new) // PS) * PS
    log = finished if finished is not None else []
    return Req(request, ENC, ENC, max_new, reserved,
               on_delta=lambda d: log.append(d) if d.finished else None)


def _output(tokens: list[int]) -> StepOutput:
    return StepOutput(torch.tensor(tokens), torch.zeros(len(tokens)), None).start_copy()


def _sched(pools: Pools) -> Scheduler:
    return Scheduler(pools, SchedulerLimits(4, 1000, EOS, 448))


def test_prefill_then_decode_rows_slots_and_finish():
    pools, done = _pools(), []
    sched = _sched(pools)
    a, b = _req(3, finished=done), _req(5, prompt=(1,), finished=done)
    sched.add(a)
    sched.add(b)
    step = sched.schedule()
    assert step.mode == ForwardMode.EXTEND and step.reqs == [a, b]
    assert (a.req_pool_idx, b.req_pool_idx) == (1, 2)
    # a: 6 encoder + 2 prompt columns = pages 1, 2; b: 6 + 1 -> pages 3, 4 (LIFO free list)
    assert pools.req_to_token_pool.req_to_token[1, :8].tolist() == list(range(4, 12))
    assert pools.req_to_token_pool.req_to_token[2, :7].tolist() == list(range(12, 19))
    assert step.prompt_ids.tolist() == [1, 2, 1]
    sched.update(step, _output([10, 20]))
    assert a.output_ids == [10] and b.output_ids == [20]
    step = sched.schedule()
    assert step.mode == ForwardMode.DECODE
    assert step.batch.out_cache_loc.tolist() == [20, 19]  # a: fresh page 5; b: slot 19
    sched.update(step, _output([11, EOS]))  # b stops on end-of-text
    assert [d.rid for d in done] == [b.rid] and done[0].output.finish_reason == FinishReason.STOP
    assert b.req_pool_idx is None and sched.running == [a]
    sched.update(sched.schedule(), _output([12]))  # a reaches max_new_tokens = 3
    assert a.output_ids == [10, 11, 12] and done[-1].output.finish_reason == FinishReason.LENGTH
    assert not sched.has_work() and sched.schedule() is None
    assert pools.allocator.available_size() == pools.allocator.size
    pools.allocator.check_integrity(torch.zeros(0, dtype=torch.int64))


def test_overlap_order_ignores_tokens_of_finished_requests():
    """schedule(N+1) before update(N): the request that stopped at N got step N+1, whose
    token is dropped; a request at its length limit is never scheduled past it."""
    pools, done = _pools(), []
    sched = _sched(pools)
    a, b = _req(2, finished=done), _req(6, finished=done)
    sched.add(a)
    sched.add(b)
    s0 = sched.schedule()  # prefill
    s1 = sched.schedule()  # decode, before s0's tokens are known
    sched.update(s0, _output([10, EOS]))  # b stopped at step 0
    s2 = sched.schedule()  # a has had 2 steps = max_new_tokens: only b would be left...
    assert s2 is None  # ...but b is finished: nothing to run
    sched.update(s1, _output([11, 77]))  # b's extra token is ignored
    assert a.output_ids == [10, 11] and b.output_ids == []
    assert [d.output.finish_reason for d in done] == [FinishReason.STOP, FinishReason.LENGTH]
    assert pools.allocator.available_size() == pools.allocator.size
    assert pools.req_to_token_pool.available_size() == 4


def test_back_pressure_admits_what_the_pool_holds():
    pools = _pools(slots=32)  # 8 pages; each request reserves ceil((6 + 2 + 8) / 4) = 4 pages
    sched = _sched(pools)
    reqs = [_req(8) for _ in range(3)]
    for r in reqs:
        sched.add(r)
    step = sched.schedule()
    assert step.reqs == reqs[:2] and list(sched.waiting) == [reqs[2]]
    sched.abort(reqs[0].rid)
    assert reqs[0].finish_reason == FinishReason.ABORT and reqs[0].req_pool_idx is None
    assert sched.schedule().reqs == [reqs[2]]  # the freed reservation admits the third


def test_finished_kv_hook_sees_the_row_before_it_is_freed():
    pools = _pools()
    sched = _sched(pools)
    seen = []

    def hook(kv):
        seen.append((kv.encoder_slots.tolist(), kv.token_ids, kv.row_slots.numel(),
                     pools.allocator.available_size()))

    a = _req(2)
    a.request.on_finished_kv = hook
    b = _req(2)
    b.request.on_finished_kv = lambda kv: (_ for _ in ()).throw(ValueError("boom"))
    sched.add(a)
    sched.add(b)
    step = sched.schedule()
    sched.update(step, _output([10, 20]))
    sched.update(sched.schedule(), _output([11, 21]))  # both reach max_new_tokens = 2
    enc, tokens, row_len, free_then = seen[0]
    assert enc == list(range(4, 10)) and tokens == [10, 11] and row_len == 6 + 2 + 1
    assert free_then < pools.allocator.size  # still held while the hook ran
    assert b.finish_reason == FinishReason.ERROR and "boom" in b.error
    assert pools.allocator.available_size() == pools.allocator.size


def _mixed_sched(pools: Pools, budget: int, mixed: bool = True) -> Scheduler:
    return Scheduler(pools, SchedulerLimits(8, budget, EOS, 448, mixed_steps=mixed))


def test_mixed_step_carries_the_decoding_rows_first():
    pools = _pools(slots=128, rows=4)
    sched = _mixed_sched(pools, 1000)
    a, b = _req(5), _req(5, prompt=(7, 8, 9))
    sched.add(a)
    sched.update(sched.schedule(), _output([10]))  # a: prefill (6 + 2 columns, pages 1-2)
    sched.add(b)
    step = sched.schedule()
    assert step.mode == ForwardMode.EXTEND and step.reqs == [a, b] and step.num_decode == 1
    assert [step.is_new(i) for i in range(2)] == [False, True]
    assert step.prompt_ids.tolist() == [7, 8, 9]  # only the new row's prompt
    assert step.batch.positions.tolist() == [2, 0, 1, 2]  # a's third token, b's prompt
    assert step.batch.cu_q.tolist() == [0, 1, 4]
    assert step.batch.seq_lens.tolist() == [3, 3] and step.batch.prefix_lens.tolist() == [2, 0]
    rtp = pools.req_to_token_pool.req_to_token
    assert step.batch.out_cache_loc.tolist() == [rtp[1, 8].item()] + rtp[2, 6:9].tolist()
    assert step.batch.encoder_out_cache_loc.tolist() == rtp[2, :6].tolist()  # b's encoder only
    sched.update(step, _output([11, 20]))
    assert a.output_ids == [10, 11] and b.output_ids == [20] and (a.steps, b.steps) == (2, 1)
    while sched.has_work():
        step = sched.schedule()
        sched.update(step, _output([12] * len(step.reqs)))
    assert pools.allocator.available_size() == pools.allocator.size


def _longest_gap(mixed: bool) -> tuple[int, list[int]]:
    """A row decoding while one request arrives before every step (budget: one request per
    step). Returns the most consecutive steps the running row was left out of, and the
    encoder + prompt tokens each step admitted."""
    pools = _pools(slots=512, rows=8)
    sched = _mixed_sched(pools, ENC + 2, mixed)
    first = _req(12)
    sched.add(first)
    gap = longest = 0
    admitted = []
    for i in range(10):
        if i < 7:
            sched.add(_req(2))
        step = sched.schedule()
        new = [r for j, r in enumerate(step.reqs) if step.is_new(j)]
        admitted.append(sum(r.enc_region + len(r.prompt_ids) for r in new))
        if first.steps and first not in step.reqs:
            gap += 1
            longest = max(longest, gap)
        elif first in step.reqs:
            gap = 0
        sched.update(step, _output([5] * len(step.reqs)))
    while sched.has_work():
        step = sched.schedule()
        sched.update(step, _output([5] * len(step.reqs)))
    assert pools.allocator.available_size() == pools.allocator.size
    return longest, admitted


def test_a_running_row_is_in_every_step_while_arrivals_prefill():
    """The "longest gap" guarantee: with mixed steps a running row takes a token in every
    step, and each step adds at most one budget of encoder + prompt tokens; without them the
    row waits for every arrival's prefill step."""
    longest, admitted = _longest_gap(mixed=True)
    assert longest == 0
    assert max(admitted) == ENC + 2 and admitted[:7] == [ENC + 2] * 7
    longest_off, _ = _longest_gap(mixed=False)
    assert longest_off == 7  # the 7 arrivals each took a prefill step of their own
