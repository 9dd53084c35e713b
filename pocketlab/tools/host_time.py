"""Where a call's host (Python) time goes: cProfile over one call, as table rows; and a decode step's timeline.

Why: a GPU call whose wall time is far above its GPU-busy time spends the rest on the host (Python, launches,
syncs); the functions with the most own time name the place, e.g. a device sync inside `.tolist()`. cProfile's own
cost swamps calls of microseconds, so a graphed decode step is timed instead by the host clock at a few points.
"""

from __future__ import annotations

import contextlib
import cProfile
import pstats
import statistics
import time
from pathlib import Path

from ..graphs import StaticInputs, StepGraphs

# where a graphed decode step stamps the host clock: (owner, function, stamp on entry, stamp on return)
STAMPED = ((StaticInputs, "load", "load", "loaded"), (StepGraphs, "replay", None, "launched"),
           (StepGraphs, "logits", None, "read"))  # fmt: skip


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


@contextlib.contextmanager
def stamping(stamps: dict[str, float]):
    """Within the block each STAMPED function writes time.perf_counter() into `stamps` under its names."""

    def stamped(f, on_entry, on_return):
        def call(*args, **kwargs):
            if on_entry:
                stamps[on_entry] = time.perf_counter()
            out = f(*args, **kwargs)
            stamps[on_return] = time.perf_counter()
            return out

        return call

    originals = [getattr(owner, name) for owner, name, _, _ in STAMPED]
    try:
        for (owner, name, on_entry, on_return), f in zip(STAMPED, originals, strict=True):
            setattr(owner, name, stamped(f, on_entry, on_return))
        yield stamps
    finally:
        for (owner, name, _, _), f in zip(STAMPED, originals, strict=True):
            setattr(owner, name, f)


def step_timeline(step, steps: int, sync=lambda: None) -> dict[str, float]:
    """Medians over `steps` calls of step() (a graphed decode step, from an idle device: `sync` first) of the host
    clock at each stamp, in us from the call: `load` (its inputs' copy starts), `loaded`, `launched` (the graph's
    replay call returned), `read` (the greedy tokens on the host, the logits' copy queued) and `done` (the step
    returned)."""
    rows = []
    with stamping({}) as stamps:
        for _ in range(steps):
            sync()
            stamps.clear()
            start = time.perf_counter()
            step()
            stamps["done"] = time.perf_counter()
            rows.append({k: (t - start) * 1e6 for k, t in stamps.items()})
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}
