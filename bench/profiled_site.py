"""Runs a command `python -m MODULE ARGS...` in this process with a cProfile of its
main thread (where a site's event loop runs), for bench/compare_checkouts.py:

    python bench/profiled_site.py OUT -- PYTHON -m MODULE ARGS...

SIGUSR1 starts a fresh profile, SIGUSR2 stops it and writes its stats to OUT (a
`pstats` file), so that only a load is profiled, not the start or the stop."""

from __future__ import annotations

import cProfile
import runpy
import signal
import sys
from types import FrameType


def main(argv: list[str]) -> None:
    out, separator, _python, dash_m, module, *arguments = argv
    if separator != "--" or dash_m != "-m":
        raise SystemExit(__doc__)
    profiles: list[cProfile.Profile] = []

    def start(_signum: int, _frame: FrameType | None) -> None:
        profiles.append(cProfile.Profile())
        profiles[-1].enable()

    def stop(_signum: int, _frame: FrameType | None) -> None:
        if profiles:
            profiles[-1].disable()
            profiles[-1].dump_stats(out)

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    sys.argv = [module, *arguments]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
