"""Random Mllama weights from edserve's own module init (no HF import) and a plain greedy run:
what ``tp_gpu.py`` and ``tests/parallel`` need on every rank (``mllama_gpu.py`` builds HF's
model instead, to compare against HF ``generate``)."""

from __future__ import annotations

import time

import torch
from mllama_hf import sync


def random_state_dict(config: dict, device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Default module init (seed 0); gates U(0.5, 1.5) and zero-initialised embeddings
    N(0, hidden^-0.5), so cross-attention and tile embeddings are not no-ops."""
    from edserve.models.mllama import MllamaConfig, MllamaModel

    torch.manual_seed(0)
    with torch.device(device):
        model = MllamaModel(MllamaConfig.from_hf(config))
    gen = torch.Generator(device=device).manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "gate" in name and p.numel() == 1:
                p.copy_(torch.rand(1, generator=gen, device=device) + 0.5)
            elif not p.any():
                p.normal_(0, p.shape[-1] ** -0.5, generator=gen)
    sd = {k: v.to(dtype) for k, v in model.state_dict().items()}
    del model
    return sd


def run(engine, case_list, steps: int) -> tuple[list[list[int]], float]:
    """Greedy, EOS ignored: (token lists, seconds in ``generate``; image preprocessing is done
    before the clock starts)."""
    from edserve.chat.mllama_request import make_mllama_request
    from edserve.engine.request import SamplingParams

    sp = SamplingParams(max_new_tokens=steps, ignore_eos=True)
    reqs = [make_mllama_request(engine.model, prompt, images, sp)
            for prompt, images in case_list]
    sync(str(engine.device))
    t = time.perf_counter()
    outs = engine.generate(reqs)
    sync(str(engine.device))
    dt = time.perf_counter() - t
    engine.check_integrity()
    return [o.token_ids for o in outs], dt


def choose_ops(device: str) -> str:
    """Triton on CUDA when its kernels take per-query KV ranges (Mllama), else torch."""
    if not device.startswith("cuda"):
        return "torch"
    from edserve.layers.attention.ops import get_ops

    return "triton" if get_ops("triton").supports_kv_ranges else "torch"
