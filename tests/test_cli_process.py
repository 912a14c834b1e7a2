"""What a long-running CLI process (worker, worker-multi, relay) does around its run."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from conveyor.cli.process import PYTHON_GC_THRESHOLD, YOUNG_GC_THRESHOLD

SERVE = textwrap.dedent("""
    import gc
    import sys
    from conveyor.cli.process import StopSignals, serve_until_stopped

    class Target:
        def install_signal_handlers(self): pass
        def request_stop(self): pass
        async def run(self):
            print(gc.get_freeze_count(), gc.get_threshold()[0], flush=True)

    made = [[n] for n in range(5000)]   # made before serving, kept for the process's life
    if sys.argv[1:]:
        gc.set_threshold(int(sys.argv[1]))   # the app's own choice
    serve_until_stopped(Target(), StopSignals(), "asyncio")
""")


def test_a_served_process_keeps_what_it_made_first_out_of_the_collectors_walks() -> None:
    # Modules, the app and the worker live as long as the process: a full
    # collection walked them all again, and a drain allocates enough to run
    # many (docs/benchmarks.md, "Behind choices in the code").
    frozen, young = _served()
    assert frozen > 5000
    assert young == YOUNG_GC_THRESHOLD != PYTHON_GC_THRESHOLD


def test_an_apps_own_collector_threshold_is_kept() -> None:
    assert _served("300")[1] == 300


def _served(*args: str) -> tuple[int, int]:
    done = subprocess.run([sys.executable, "-c", SERVE, *args], capture_output=True, text=True,
                          timeout=60, check=True)
    frozen, young = done.stdout.split()
    return int(frozen), int(young)
