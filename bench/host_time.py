"""Where a step's host time goes: one run of it under cProfile, its functions by own time and by time inside.

`bench.step_profile --host` prints this per mode. It found that tree execution had been host-bound: fla's KDA
kernels launched call by call cost far more host time than kernel time (now one Function per layer,
`models.ops.kda.tree_calls`; docs/history.md, "the host set carry's pace"). Host time includes waiting: a launch
blocks while the device's queue is full, and a synchronisation until the device drains, so a function's time here
is an upper bound on its own cost; "timed run - kernels" and `bench.idle` say whether the device waited at all.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time

__all__ = ["host_profile"]


def host_profile(fn, rows: int = 25, sync=None) -> str:
    """Run `fn` once under cProfile (after `sync()` if given, and `sync()` again after it) and return the report:
    its wall time, then the `rows` functions with the most own time and the `rows` with the most time inside."""
    profile = cProfile.Profile()
    if sync is not None:
        sync()
    start = time.perf_counter()
    profile.enable()
    fn()
    profile.disable()
    if sync is not None:
        sync()
    wall = time.perf_counter() - start
    out = io.StringIO()
    print(f"host under cProfile: {wall:.2f} s", file=out)
    for key, title in (("tottime", "own time"), ("cumtime", "time inside")):
        print(f"by {title}:", file=out)
        pstats.Stats(profile, stream=out).sort_stats(key).print_stats(rows)
    return out.getvalue()
