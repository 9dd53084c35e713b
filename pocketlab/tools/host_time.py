"""Where a call's host (Python) time goes: cProfile over one call, as table rows.

Why: a GPU call whose wall time is far above its GPU-busy time spends the rest on the host (Python, launches,
syncs); the functions with the most own time name the place, e.g. a device sync inside `.tolist()`.
"""

from __future__ import annotations

import cProfile
import pstats
import time
from pathlib import Path


def profile_call(fn, n: int, key: str = "cumulative_s") -> tuple[float, list[dict]]:
    """Run fn() once under cProfile: its seconds and the n functions with the most `key` time
    (cumulative_s or own_s)."""
    import torch

    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.runcall(fn)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    rows = []
    for (file, line, name), (_, calls, own, cumulative, _) in stats.items():
        where = f"{Path(file).name}:{line}({name})" if line else name
        rows.append({"function": where, "calls": calls, "own_s": own, "cumulative_s": cumulative})
    return seconds, sorted(rows, key=lambda r: -r[key])[:n]
