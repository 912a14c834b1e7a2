"""Instructions a Python process runs, counted by valgrind's callgrind.

Timings on a shared machine move by half from run to run; instruction counts
do not. The benchmarks that count (``benchmarks/hook_instructions.py``,
``benchmarks/claim_rows.py``) run a process twice with more and less work and
take the difference, start-up and imports cancelled out.
"""

from __future__ import annotations

import re
import subprocess
import sys


def instructions(argv: list[str], env: dict[str, str] | None = None) -> int:
    """Instructions of ``python argv...`` (this interpreter) under callgrind; needs
    valgrind on the PATH."""
    done = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
                           sys.executable, *argv],
                          capture_output=True, text=True, check=True, env=env)
    found = re.search(r"Collected : (\d+)", done.stderr)
    if found is None:
        raise SystemExit(f"no instruction count from valgrind:\n{done.stderr[-2000:]}")
    return int(found.group(1))
