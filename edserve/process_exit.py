"""Ending the ``edserve`` process without the interpreter's teardown.

A Python process that imported torch spends ~0.75 s in interpreter finalization after its
work is done (module teardown of ~1,300 modules and torch's static destructors; measured on
the 2-core development machine: ``python -c "import torch"`` 2.41 s, 1.57 s ending with
``os._exit``). For a one-shot command such as ``edserve transcribe clip.wav`` that is a fifth
of its wall time. :func:`run` runs the command, then ends the process with :func:`exit_now`:

* ``atexit`` handlers still run (logging's flush, temporary-directory cleanup,
  multiprocessing's joins of its children), then stdout and stderr are flushed;
* while any non-daemon thread other than the main one is alive, the ordinary exit is taken
  instead (it waits for those threads; ``os._exit`` would kill them mid-work);
* an exception escaping the command is not caught here: Python prints it and exits as usual.

Only the console entry points use it (``edserve``, ``python -m edserve``); ``edserve.cli.main``
stays an ordinary function for tests and embedding.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Callable
from typing import NoReturn


def _other_live_threads() -> bool:
    main = threading.main_thread()
    return any(t is not main and not t.daemon and t.is_alive() for t in threading.enumerate())


def exit_now(code: int) -> NoReturn:
    """Run the ``atexit`` handlers, flush stdout/stderr and end the process with ``code``
    (``sys.exit(code)`` instead while a non-daemon thread is still running)."""
    if _other_live_threads():
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (``edserve ... | head``) or stream
            pass
    os._exit(code)


def run(command: Callable[[], object]) -> NoReturn:
    """Run ``command`` (which may ``sys.exit``) and end the process as :func:`exit_now` does,
    with the exit status ``sys.exit`` would give: None -> 0, an int as is, any other value
    printed to stderr -> 1."""
    try:
        command()
        code: object = 0
    except SystemExit as exc:
        code = exc.code
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    exit_now(code)
