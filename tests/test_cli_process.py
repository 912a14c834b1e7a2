"""What a long-running CLI process (worker, worker-multi, relay) does around its run."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SERVE = textwrap.dedent("""
    import gc
    from conveyor.cli.process import StopSignals, serve_until_stopped

    class Target:
        def install_signal_handlers(self): pass
        def request_stop(self): pass
        async def run(self):
            print(gc.get_freeze_count(), flush=True)

    made = [[n] for n in range(5000)]   # made before serving, kept for the process's life
    serve_until_stopped(Target(), StopSignals(), "asyncio")
""")


def test_a_served_process_keeps_what_it_made_first_out_of_the_collectors_walks() -> None:
    # Modules, the app and the worker live as long as the process: a full
    # collection walked them all again, and a drain allocates enough to run
    # many (docs/benchmarks.md, "Behind choices in the code").
    done = subprocess.run([sys.executable, "-c", SERVE], capture_output=True, text=True,
                          timeout=60, check=True)
    assert int(done.stdout) > 5000, done.stdout
