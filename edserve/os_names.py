"""Thread names the operating system sees (Linux ``comm``), so ``top -H``, py-spy and the
serving benchmarks' /proc readings can tell the engine's stepping thread from the API's."""

from __future__ import annotations

ENGINE_THREAD = "edserve-engine"
"""The stepping thread's name: ``AsyncEngine``'s loop thread in the server's process, or an
engine worker process's main thread (``--engine-process``, ``--data-parallel-size``)."""


def name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` in the OS too (``comm`` keeps 15 bytes; for a
    process's main thread that is also the process name ``ps`` shows). A no-op off Linux."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass
