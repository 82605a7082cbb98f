"""The compiled CPU decode step with and without dynamo's full guard check (wave 28's command):
``cpu_step_ab.py --change guards``, whose ``off`` rows are the full check.

  python benchmarks/cpu_guard_ab.py [--mode int8] [--beam 1] [--rounds 10]
"""

from __future__ import annotations

import sys

import cpu_step_ab


def main(argv: list[str] | None = None) -> int:
    return cpu_step_ab.main(["--change", "guards", *(argv or sys.argv[1:])])


if __name__ == "__main__":
    sys.exit(main())
