"""A device beam step's work after sampling as one CUDA-graph replay.

:meth:`~edserve.engine.beam_rows.DeviceBeams.apply` (candidates into the choice's buffers, the
choice, the rows' page tables and partial pages, the token histories) is ~80 small launches
when run eagerly with only the choice as a graph: on the H200 a tiny.en batch of 64 greedy rows
and one beam-5 request spent ~5 ms of host time per step on them against ~1 ms of GPU work
(GPU busy 15-17 %; benchmarks/RESULTS.md, wave 19). Captured, a step costs three device copies
(the packed plan and the candidates into static buffers) and one replay.

A graph is specific to its shapes: the plan's ``(R, P)``, the candidates' width, the choice's
launches (:meth:`~edserve.engine.beam_device.BeamBatch.shape_key`: its kernel or ops, widest
beam, finished-buffer width and stop table), and the token history it edits. A shape runs
eagerly the first time it is seen (the warm-up: kernels compiled, lazy library state set up,
without running a step twice) and is captured the second time, then replayed; at most
:data:`MAX_GRAPHS` are kept (least recently used go first). A failed capture (it runs nothing)
turns the graphs off for good, with a warning; K/V copies watched by other ranks (tensor
parallel) always run eagerly.

Contract: outputs equal the eager path's (the same ops on the same inputs); the returned done
flags are valid until the next step's replay (the caller copies them to the host in stream
order, before that replay).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from edserve.engine.graph_capture import capture

logger = logging.getLogger("edserve")

# The graphs serve the beam_rows.DeviceBeams that owns them (``beams``: its ``state``, ``apply``,
# ``views`` and ``pools``), passed to every call, not kept: a kept owner would be a reference
# cycle holding the engine's KV pool after the engine is dropped (found on the H200). Its
# BeamStepPlan and TokenHistory are typed Any here, as beam_rows imports this module.
BeamStepPlan = DeviceBeams = TokenHistory = Any

#: Captured shapes kept at once (a batch's set of beam rows changes rarely in steady state).
MAX_GRAPHS = 8


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph  # (anything with replay(); tests record eagerly)
    packed: torch.Tensor  # [n] int64 static plan
    toks: torch.Tensor  # [R, kk] int64 static candidates
    lps: torch.Tensor  # [R, kk] static log-probs
    done: torch.Tensor  # [capacity] bool static output


class BeamRunGraphs:
    """``run(beams, plan, toks, lps, history)``: :meth:`DeviceBeams.apply` eagerly for a new
    shape, captured at its second occurrence, replayed after that. One instance serves one
    ``beams`` (its captured graphs write that object's buffers)."""

    def __init__(self, max_graphs: int = MAX_GRAPHS) -> None:
        self.max_graphs = max_graphs
        self._graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        self._seen: set[tuple] = set()
        self.captures = 0
        self.replays = 0
        self.broken = False  # a capture failed: eager from then on

    @staticmethod
    def _key(beams: DeviceBeams, plan: BeamStepPlan, toks: torch.Tensor,
             history: TokenHistory) -> tuple:
        """Everything a captured graph's shapes depend on (the packed plan's length follows
        from ``R`` and ``P``)."""
        return plan.R, plan.P, toks.shape[1], *beams.state.shape_key(), id(history)

    def run(self, beams: DeviceBeams, plan: BeamStepPlan, toks: torch.Tensor,
            lps: torch.Tensor, history: TokenHistory) -> torch.Tensor:
        if self.broken or beams.pools.kv_pool.copy_observers:
            # K/V copies that other ranks must hear of (tensor parallel) are host calls a
            # replay would not repeat
            return beams.apply(plan, toks, lps, history)
        key = self._key(beams, plan, toks, history)
        cap = self._graphs.get(key)
        if cap is None:
            if key not in self._seen:  # first time: eager (the warm-up)
                if len(self._seen) >= 64 * self.max_graphs:  # bounded (shapes come and go)
                    self._seen.clear()
                self._seen.add(key)
                return beams.apply(plan, toks, lps, history)
            try:
                cap = self._capture(beams, key, plan, toks, lps, history)
            except Exception:  # a capture runs nothing: the eager path is still exact
                logger.warning("capturing a beam step failed; device beams run eagerly from "
                               "now on", exc_info=True)
                self.broken = True
                return beams.apply(plan, toks, lps, history)
        self._graphs.move_to_end(key)
        cap.packed.copy_(plan.packed, non_blocking=True)
        cap.toks.copy_(toks, non_blocking=True)
        cap.lps.copy_(lps, non_blocking=True)
        cap.graph.replay()
        self.replays += 1
        return cap.done

    def _capture(self, beams: DeviceBeams, key: tuple, plan: BeamStepPlan, toks: torch.Tensor,
                 lps: torch.Tensor, history: TokenHistory) -> _Captured:
        while len(self._graphs) >= self.max_graphs:
            self._graphs.popitem(last=False)
        packed = torch.empty_like(plan.packed)
        s_toks, s_lps = torch.empty_like(toks), torch.empty_like(lps)
        done = torch.empty(beams.state.G, dtype=torch.bool, device=packed.device)

        def body() -> None:  # reads only the static inputs, writes ``done``
            static = beams.views(packed, plan.R, plan.P)
            done.copy_(beams.apply(static, s_toks, s_lps, history, captured=True))

        cap = _Captured(self._record(body, packed.device), packed, s_toks, s_lps, done)
        self._graphs[key] = cap
        self.captures += 1
        return cap

    @staticmethod
    @torch.inference_mode()
    def _record(body, device: torch.device):
        """``body``'s launches captured as a CUDA graph (not run: replay runs them)."""
        return capture(body, device)[0]
