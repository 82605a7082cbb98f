"""asyncio front of the engine: one background thread steps the engine; coroutines submit.

The engine thread loops: run at most one queued call, then ``engine.step()`` while there is
work (so callers polling the engine thread can never starve decoding), then the step hooks
(e.g. a stats snapshot), else sleep on an Event until a submit wakes it. Requests from many
coroutines (HTTP handlers) join the same continuous batch. Deltas cross back to the event loop
with ``call_soon_threadsafe`` into a per-request ``asyncio.Queue`` (no shared per-request
state). A consumer that stops early (client disconnect, task cancelled) aborts its request,
so its row and KV slots are freed at the next step. In-flight bookkeeping and the failed-step
rule are the :class:`~edserve.engine.core.EngineCore`'s (shared with the data-parallel worker).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from edserve.engine.core import EngineCore
from edserve.engine.errors import RequestFailed
from edserve.engine.outputs import GenerateOutput, TokenDelta
from edserve.engine.request import GenerateRequest
from edserve.os_names import ENGINE_THREAD, name_os_thread

logger = logging.getLogger("edserve")
T = TypeVar("T")


class AsyncEngine:
    """Wraps an :class:`~edserve.engine.engine.Engine`; call :meth:`start` once, then use
    :meth:`generate` / :meth:`stream` from any event loop, :meth:`shutdown` at the end."""

    def __init__(self, engine: Any, idle_poll_s: float = 1.0) -> None:
        self.engine = engine
        self.core = EngineCore(engine)
        self._idle_poll_s = idle_poll_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future]] = \
            queue.SimpleQueue()
        self._hooks: list[Callable[[], None]] = []
        self._thread = threading.Thread(target=self._loop, name=ENGINE_THREAD, daemon=True)

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self) -> AsyncEngine:
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop after the current step (requests still running are abandoned)."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    @property
    def num_inflight(self) -> int:
        return self.core.num_inflight

    def _loop(self) -> None:
        name_os_thread(self._thread.name)
        self.engine.warm_up()  # kernel choices made on this thread, before the first request
        self._run_hooks()
        while not self._stop.is_set():
            called = self._run_one_call()
            if self.engine.has_work():
                self.core.step()  # a failed step fails what was in flight; we keep serving
                self._run_hooks()
            else:
                if called:  # a call (e.g. releasing a held encoder) may have freed KV
                    self._run_hooks()
                if self._calls.empty():
                    asleep = time.perf_counter()
                    self._wake.wait(self._idle_poll_s)
                    self._wake.clear()
                    self.engine.step_counters.idle_seconds += time.perf_counter() - asleep

    def _run_one_call(self) -> bool:
        """At most one queued call per loop turn: one per engine step while there is work.
        Returns whether a call was taken."""
        try:
            fn, fut = self._calls.get_nowait()
        except queue.Empty:
            return False
        if fut.set_running_or_notify_cancel():
            try:
                fut.set_result(fn())
            except BaseException as exc:
                fut.set_exception(exc)
        return True

    def _run_hooks(self) -> None:
        for hook in self._hooks:
            try:
                hook()
            except Exception:
                logger.exception("engine step hook failed")

    def add_step_hook(self, hook: Callable[[], None]) -> None:
        """Run ``hook()`` on the engine thread after every step (and once at start); keep it
        cheap (no tensor work): it runs between steps."""
        self._hooks.append(hook)

    # ---- calls on the engine thread ----------------------------------------------------
    def call_soon(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn()`` on the engine thread between steps (e.g. ``engine.check_integrity``);
        at most one such call runs per engine step."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._calls.put((fn, fut))
        self._wake.set()
        return fut

    async def call(self, fn: Callable[[], T]) -> T:
        return await asyncio.wrap_future(self.call_soon(fn))

    # ---- requests -----------------------------------------------------------------------
    async def stream(self, request: GenerateRequest, per_token: bool = True
                     ) -> AsyncIterator[TokenDelta]:
        """Submit ``request`` and yield its deltas; the last one has ``finished`` and ``output``
        (``per_token`` False: only that one; no per-token hop across threads).

        Raises ValueError (from the engine's validation) before yielding anything. Closing or
        cancelling the iterator before the last delta aborts the request. An encoder handle
        (``share_encoder`` / ``keep_encoder``) is the consumer's once its delta is yielded;
        one in a delta never yielded (the iterator closed first) is released here.
        """
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue[TokenDelta] = asyncio.Queue()
        rid = request.rid
        closed = False

        def put(delta: TokenDelta) -> None:  # event loop: ordered with the finally below
            if closed:
                self._release_handles(delta)
            else:
                deltas.put_nowait(delta)

        def deliver(delta: TokenDelta) -> None:  # engine thread
            try:
                loop.call_soon_threadsafe(put, delta)
            except RuntimeError:  # the event loop is closed: nobody is listening
                self._release_handles(delta)

        self.core.submit(request, deliver, stream=per_token)
        self._wake.set()
        finished = False
        try:
            while not finished:
                delta = await deltas.get()
                finished = delta.finished
                yield delta
        finally:
            closed = True
            if not finished:
                self.core.abort(rid)
                self._wake.set()
            while not deltas.empty():
                self._release_handles(deltas.get_nowait())

    def _release_handles(self, delta: TokenDelta) -> None:
        """Release the encoder handles of a delta nobody will read (any thread)."""
        for handle in delta.encoder_handles():
            self.engine.release_encoder(handle)
            self._wake.set()

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """Run ``request`` to completion; cancellation aborts it (its KV is freed). The output
        may still say ``FinishReason.ERROR``/``ABORT``; :class:`RequestFailed` when the stream
        ended without one."""
        stream = self.stream(request, per_token=False)
        try:
            async for delta in stream:
                if delta.finished:
                    assert delta.output is not None
                    return delta.output
        finally:
            await stream.aclose()
        raise RequestFailed(f"request {request.rid} ended without output", request.rid)
