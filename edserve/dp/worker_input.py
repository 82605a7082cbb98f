"""An engine worker's input thread: :class:`InputThread`.

The API process's messages are received, decoded and, for requests, admitted (validation, a
grammar's compile, the encoder input staged in page-locked memory) on a thread of their own, so
the stepping thread only steps; the admission work runs while it waits for the device
(``Event.synchronize`` releases the GIL). On an H200 at 32 clients the stepping thread had
spent ~11 % of its samples receiving and submitting (py-spy, wave 36). vLLM's engine-core
process receives and decodes on input threads for the same reason.

What runs where (the worker loop's two handler tables):

- here, in arrival order: ``Generate`` and ``Abort`` (the engine's submission inbox is
  thread-safe), ``ReleaseMel`` (the log-mel store is locked), and the ``validate`` and
  ``features`` calls;
- on the stepping thread, between steps: what reads or changes the scheduler's state
  (``ReleaseEncoder``, the ``integrity`` and ``encoder`` calls, ``Stop``), handed over by
  :meth:`InputThread.defer` and dispatched by the loop's :meth:`InputThread.drain`.

Every message sets :attr:`InputThread.wake`, so an idle loop steps as soon as work arrives. An
exception here (a message that does not decode, a handler that raises where it should have
answered) is kept in :attr:`InputThread.error`; the loop raises it, so the worker exits and
its supervisor restarts it (as when one thread did both).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Mapping
from typing import Any

import zmq

from edserve.dp import wire
from edserve.os_names import name_os_thread

logger = logging.getLogger("edserve.dp")
INPUT_THREAD = "edserve-input"
POLL_MS = 100  # how often a quiet input thread checks whether to stop


class InputThread(threading.Thread):
    """Receives on ``down`` (its only user once started) and runs ``handlers[type(msg)]``;
    messages with no handler here are deferred to the loop."""

    def __init__(self, down: zmq.Socket, handlers: Mapping[type, Callable[[Any], None]]) -> None:
        super().__init__(name=INPUT_THREAD, daemon=True)
        self.down, self.handlers = down, handlers
        self.wake = threading.Event()
        self.error: BaseException | None = None
        self._deferred: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._stopping = threading.Event()

    def run(self) -> None:
        name_os_thread(INPUT_THREAD)
        poller = zmq.Poller()
        poller.register(self.down, zmq.POLLIN)
        try:
            while not self._stopping.is_set():
                if poller.poll(POLL_MS):
                    self._drain_socket()
        except BaseException as exc:  # noqa: BLE001 - handed to the loop, which raises it
            logger.exception("worker input thread failed")
            self.error = exc
            self.wake.set()

    def _drain_socket(self) -> None:
        while True:
            try:
                msg = wire.recv(self.down, zmq.NOBLOCK)
            except zmq.Again:
                return
            handler = self.handlers.get(type(msg))
            if handler is None:
                self.defer(msg)
            else:
                handler(msg)
            self.wake.set()

    def defer(self, msg: Any) -> None:
        """Hand ``msg`` to the stepping thread (dispatched by its next :meth:`drain`)."""
        self._deferred.put(msg)
        self.wake.set()

    def drain(self, dispatch: Callable[[Any], None]) -> None:
        """On the stepping thread: dispatch the deferred messages in arrival order; raise what
        failed this thread."""
        if self.error is not None:
            raise RuntimeError("worker input thread failed") from self.error
        while True:
            try:
                msg = self._deferred.get_nowait()
            except queue.Empty:
                return
            dispatch(msg)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop receiving (within :data:`POLL_MS`) and wait for the thread."""
        self._stopping.set()
        if self.is_alive():
            self.join(timeout)
