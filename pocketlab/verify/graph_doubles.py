"""CUDA graphs on the CPU: a StepGraphs whose "graph" re-runs the captured function, so everything around a capture
(static input buffers, padding, bucket choice, outputs handed back, the eager fallback) runs for real without a GPU.
The tests and the schedule fuzzer use it; the GPU runs check real captures."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ..graphs import StepGraphs


def copy_into(dst, src) -> None:
    """Write what a re-run returned into the objects the capture returned (tensors in place, recursively)."""
    if src is None or isinstance(dst, (int, float, str)):
        return
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, (list, tuple)):
        for a, b in zip(dst, src, strict=True):
            copy_into(a, b)
    elif isinstance(dst, dict):
        for key in dst:
            copy_into(dst[key], src[key])
    elif hasattr(dst, "__dict__"):
        for key, value in vars(dst).items():
            copy_into(value, getattr(src, key, None))


class RerunGraphs(StepGraphs):
    """StepGraphs whose 'graph' re-runs the captured function and writes its results into the outputs of the
    capture, as a replay overwrites a graph's static outputs."""

    def record(self, fn):
        out = fn()  # the warm-up run; a real capture records without running
        return SimpleNamespace(replay=lambda: copy_into(out, fn())), out


def rerun_graphs(engine):
    """`engine` with RerunGraphs in place of its graphs (which the CPU has none of); returns it."""
    engine.graphs = RerunGraphs(engine.model, engine.cache, engine.options)
    return engine
