"""Runs a command `python -m MODULE ARGS...` in this process with tracemalloc on, for
bench/conn_memory.py's `--trace`:

    python bench/traced_site.py OUT_PREFIX -- PYTHON -m MODULE ARGS...

SIGUSR1 writes a snapshot to OUT_PREFIX.before, SIGUSR2 to OUT_PREFIX.after, so that
what the connections made in between can be told from what the site holds anyway."""

from __future__ import annotations

import gc
import runpy
import signal
import sys
import tracemalloc

FRAMES = 12  # deep enough to reach the broker's own code under asyncio's


def main(argv: list[str]) -> None:
    out, separator, _python, dash_m, module, *arguments = argv
    if separator != "--" or dash_m != "-m":
        raise SystemExit(__doc__)
    tracemalloc.start(FRAMES)

    def snapshot(suffix: str) -> None:
        gc.collect()
        tracemalloc.take_snapshot().dump(f"{out}.{suffix}")

    signal.signal(signal.SIGUSR1, lambda _s, _f: snapshot("before"))
    signal.signal(signal.SIGUSR2, lambda _s, _f: snapshot("after"))
    sys.argv = [module, *arguments]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
