"""How a step's beam choice (:meth:`~edserve.engine.beam_device.BeamBatch.step`) is launched:
eagerly, or as one CUDA-graph replay.

The choice is ~230 small tensor ops over fixed ``[G, B, ...]`` shapes (or one Triton launch:
``BeamBatch(choice="triton")``, the default on CUDA). Eagerly the ops' launches cost the host a
few ms per step on the H200, more than the device work (H200, large-v3, 64 requests x beam 5:
GPU busy 52 % of a 15-17 ms step). The launches depend only on the batch's capacity and
:meth:`~edserve.engine.beam_device.BeamBatch.shape_key` (the widest beam, the finished
buffer's width ``F``, the stop table's width), so one captured graph serves every step until a
request widens one of them (a wider beam, ``patience`` > 1, more stop tokens than before); the
graph is then captured again (a host sync and an allocator flush, once).

A stepper owns the step's input buffers (``[G, B, T]`` candidates, ``[G]`` length limits): the
caller fills them (:meth:`BeamStepper.inputs` resets the candidates to "no candidate"; the
limits keep the last step's values, the caller writes them whole) and calls
:meth:`BeamStepper.step`. The choice's tensors are valid until the next step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from edserve.engine.beam_choices import BeamChoice
from edserve.engine.beam_device import BeamBatch
from edserve.engine.graph_capture import capture


class BeamStepper:
    """Eager launches (any device)."""

    name = "eager"

    def __init__(self, state: BeamBatch, T: int) -> None:
        G, B, dev = state.G, state.B, state.device
        self.state = state
        self.cand_tokens = torch.zeros(G, B, T, dtype=torch.int64, device=dev)  # [G, B, T]
        self.cand_logprobs = torch.full((G, B, T), float("-inf"), device=dev)  # [G, B, T] fp32
        self.at_limit = torch.zeros(G, dtype=torch.bool, device=dev)  # [G]

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's input buffers: candidates reset (none anywhere), limits as last written
        (all False at first; the engine overwrites them whole every step)."""
        self.cand_tokens.zero_()
        self.cand_logprobs.fill_(float("-inf"))
        return self.cand_tokens, self.cand_logprobs, self.at_limit

    def step(self) -> BeamChoice:
        return self.state.step(self.cand_tokens, self.cand_logprobs, self.at_limit)


class GraphBeamStepper(BeamStepper):
    """One CUDA-graph replay per step (CUDA only). Captured at construction and again whenever
    the state's shapes change (see the module doc)."""

    name = "graph"

    def __init__(self, state: BeamBatch, T: int) -> None:
        if state.device.type != "cuda":
            raise ValueError("GraphBeamStepper needs a CUDA device")
        super().__init__(state, T)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._key: tuple | None = None
        self._out: BeamChoice | None = None
        self.captures = 0
        self._capture()

    def _shape_key(self) -> tuple:
        return self.state.shape_key()

    @torch.inference_mode()
    def _capture(self) -> None:
        st = self.state
        self._graph = self._out = None  # free the old graph's pool first

        def warm_up() -> None:  # on the live state (lazy inits of sort/scan), then put it back
            saved = {k: t.clone() for k, t in st.tensors().items()}
            st.step(self.cand_tokens, self.cand_logprobs, self.at_limit)
            for k, t in st.tensors().items():
                t.copy_(saved[k])

        graph, out = capture(lambda: st.step(self.cand_tokens, self.cand_logprobs,
                                             self.at_limit), st.device, before=warm_up)
        self._graph, self._out, self._key = graph, out, self._shape_key()
        self.captures += 1

    def step(self) -> BeamChoice:
        if self._shape_key() != self._key:
            self._capture()
        self._graph.replay()
        return self._out


#: name -> stepper class; :func:`make_beam_stepper` picks one by device.
BEAM_STEPPERS: dict[str, Callable[[BeamBatch, int], BeamStepper]] = {
    "eager": BeamStepper,
    "graph": GraphBeamStepper,
}


def make_beam_stepper(state: BeamBatch, T: int, name: str | None = None) -> BeamStepper:
    """``name`` from :data:`BEAM_STEPPERS`; None: a graph on CUDA, eager elsewhere."""
    if name is None:
        name = "graph" if state.device.type == "cuda" else "eager"
    if name not in BEAM_STEPPERS:
        raise ValueError(f"unknown beam stepper {name!r}; known: {sorted(BEAM_STEPPERS)}")
    return BEAM_STEPPERS[name](state, T)
