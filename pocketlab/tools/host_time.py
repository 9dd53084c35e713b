"""Where a call's host (Python) time goes: cProfile over one call, as table rows; a decode step's timeline; and its
ladder.

Why: a GPU call whose wall time is far above its GPU-busy time spends the rest on the host (Python, launches,
syncs); the functions with the most own time name the place, e.g. a device sync inside `.tolist()`. cProfile's own
cost swamps calls of microseconds, so a graphed decode step is timed instead by the host clock at a few points, and
by a ladder of calls that each add one piece of the step to its graph's replay, all at the same keys.
"""

from __future__ import annotations

import contextlib
import cProfile
import pstats
import statistics
import time
from pathlib import Path

import torch

from ..forward import Run
from ..graphs import StaticInputs, StepGraphs

# where a graphed decode step stamps the host clock: (owner, function, stamp on entry, stamp on return)
STAMPED = ((StaticInputs, "load", "load", "loaded"), (StepGraphs, "replay", None, "launched"),
           (StepGraphs, "launch_ahead", None, "ahead"), (StepGraphs, "logits", None, "read"))  # fmt: skip


def profile_call(fn, n: int, key: str = "cumulative_s") -> tuple[float, list[dict]]:
    """Run fn() once under cProfile: its seconds and the n functions with the most `key` time
    (cumulative_s or own_s)."""
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
    clock at each stamp every call took, in us from the call, in time order: `load` (its inputs' copy starts),
    `loaded`, `launched` (the graph's replay call returned), `read` (the greedy tokens on the host, the logits' copy
    queued) and `done` (the step returned). Where the engine launches steps ahead, a call served by the step the
    call before launched replays nothing (no `launched`); its `load` and `loaded` are the next step's inputs, and
    `ahead` is when that step was launched."""
    rows = []
    with stamping({}) as stamps:
        for _ in range(steps):
            sync()
            stamps.clear()
            start = time.perf_counter()
            step()
            stamps["done"] = time.perf_counter()
            rows.append({k: (t - start) * 1e6 for k, t in stamps.items()})
    every = set.intersection(*(set(r) for r in rows))
    return dict(sorted(((k, statistics.median(r[k] for r in rows)) for k in every), key=lambda kv: kv[1]))


def step_ladder(engine, reqs: list, steps: int, sync=lambda: None) -> dict[str, float]:
    """Medians over `steps` calls, each from an idle device (`sync` first), in us, of a graphed decode step of the
    prefilled `reqs` built up piece by piece: `graph` (the step's decode graph replayed alone), `load` (its inputs'
    copy first), `logits` (StepGraphs.logits: the logits' copy and the greedy tokens read back too), `engine` (the
    engine's checks, sampling and slot histories too) and `step` (the public batch_decode_step). Every slot and
    request is cut back to where it was after each call, so every rung attends over the same keys (a hybrid
    model's states move on regardless: reset the slots after)."""
    graphs = engine.graphs
    assert graphs is not None and engine.speculator is None, "the ladder times a graphed plain decode step"
    engine.batch_decode_step(reqs)  # captures the graph, and gives every request a token to feed
    captured = graphs.last
    assert captured is not None
    slots = [engine.cache.slots[r.slot_id] for r in reqs]
    positions, generated = [s.position for s in slots], [len(r.generated_tokens) for r in reqs]
    runs = [Run(r.slot_id, p, [r.last_token]) for r, p in zip(reqs, positions, strict=True)]
    items = [(r.slot_id, r.last_token, r.sampling) for r in reqs]

    def replay():
        captured.graph.replay()
        sync()

    rungs = {
        "graph": replay,
        "load": lambda: (captured.inputs.load(runs, engine.cache.scratch, False), replay()),
        "logits": lambda: (graphs.logits(runs), sync()),
        "engine": lambda: engine._decode(items),
        "step": lambda: engine.batch_decode_step(reqs),
    }
    times: dict[str, list[float]] = {name: [] for name in rungs}
    with torch.inference_mode():  # as the engine's calls run: the graph's buffers are inference tensors
        for _ in range(steps):
            for name, call in rungs.items():
                sync()
                start = time.perf_counter()
                call()
                times[name].append((time.perf_counter() - start) * 1e6)
                for slot, p in zip(slots, positions, strict=True):
                    slot.truncate(p)
                for r, n in zip(reqs, generated, strict=True):
                    del r.generated_tokens[n:]
    return {name: statistics.median(t) for name, t in times.items()}
