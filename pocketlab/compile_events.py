"""What makes a call stall, counted: CUDA-graph captures, torch.compile graphs, Triton kernel compiles.

Warm-up's promise (no call compiles or captures after it) is checked by reading these before and after a run
of calls; the bench reports the difference next to its latency percentiles.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch._dynamo.utils

_triton: dict[str, Any] = {"compiles": 0, "hooked": False}


def _count_triton(*args, **kwargs) -> Any:
    _triton["compiles"] += 1
    return _triton["chained"](*args, **kwargs) if _triton.get("chained") else None


def track_triton() -> None:
    """Count every Triton kernel a process compiles or loads from disk (not in the interpreter: it compiles none)."""
    if _triton["hooked"] or importlib.util.find_spec("triton") is None:
        return
    from triton import knobs

    _triton["chained"] = knobs.runtime.jit_post_compile_hook  # someone else's hook keeps running
    knobs.runtime.jit_post_compile_hook = _count_triton
    _triton["hooked"] = True


def counts(graphs=None) -> dict[str, int]:
    """Totals so far in this process (graph captures: of this engine's StepGraphs, when given)."""
    return {
        "graph_captures": graphs.captures if graphs is not None else 0,
        "compiled_graphs": int(torch._dynamo.utils.counters["stats"]["unique_graphs"]),
        "triton_compiles": _triton["compiles"],
    }


def since(before: dict[str, int], graphs=None) -> dict[str, int]:
    """What happened after `before` (a counts() result)."""
    now = counts(graphs)
    return {name: now[name] - before[name] for name in now}
