"""edserve.process_exit: the console entry's exit without the interpreter's teardown keeps
exit statuses, atexit handlers, buffered output and running threads' work."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(body: str) -> subprocess.CompletedProcess:
    code = "import atexit, sys, threading, time\nfrom edserve.process_exit import run\n" + body
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)


@pytest.mark.parametrize("command, status, err", [
    ("lambda: None", 0, ""),
    ("lambda: sys.exit(3)", 3, ""),
    ("lambda: sys.exit(None)", 0, ""),
    ("lambda: sys.exit('edserve: bad input')", 1, "edserve: bad input\n"),
])
def test_exit_status_and_atexit(command, status, err):
    # stdout is a pipe here: block-buffered, so the text is lost unless it is flushed
    res = _run("atexit.register(lambda: print('atexit ran'))\n"
               "print('working', end=' ')\n"
               f"run({command})\n"
               "print('not reached')\n")
    assert res.returncode == status
    assert res.stdout == "working atexit ran\n"
    assert res.stderr == err


def test_exception_is_not_swallowed():
    res = _run("def boom():\n    raise RuntimeError('kaput')\nrun(boom)\n")
    assert res.returncode == 1
    assert "RuntimeError: kaput" in res.stderr


def test_waits_for_a_running_thread():
    # a non-daemon thread still working: the ordinary exit, which waits for it
    res = _run("def late():\n    time.sleep(0.3)\n    print('thread done', flush=True)\n"
               "run(lambda: threading.Thread(target=late).start())\n")
    assert res.returncode == 0
    assert res.stdout == "thread done\n"


def test_console_entry_transcribes():
    """``python -m edserve`` (the console entry) prints the text and exits 0; a bad file
    exits 1 with its message."""
    ok = subprocess.run([sys.executable, "-m", "edserve", "transcribe",
                         str(ROOT / "tests" / "data" / "jfk.wav"), "--beam-size", "1"],
                        capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert "ask not what your country can do for you" in ok.stdout.lower()
    bad = subprocess.run([sys.executable, "-m", "edserve", "transcribe",
                          str(ROOT / "README.md")], capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert bad.returncode == 1
    assert "cannot decode audio" in bad.stderr
