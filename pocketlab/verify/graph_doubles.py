"""CUDA graphs on the CPU: a StepGraphs whose "graph" re-runs the captured function, so everything around a capture
(static input buffers, padding, bucket choice, outputs handed back, the eager fallback) runs for real without a GPU,
and whose every replay spoils the other graphs' outputs, as the real graphs' shared memory pool may. The tests and the
schedule fuzzer use it; the GPU runs check real captures."""

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


def spoil(out) -> None:
    """Overwrite what a capture returned (tensors, recursively): NaN where it holds floats, -1 where integers."""
    if isinstance(out, torch.Tensor):
        out.fill_(float("nan") if out.is_floating_point() else -1)
    elif isinstance(out, (list, tuple)):
        for x in out:
            spoil(x)


class SharedPoolGraphs(RerunGraphs):
    """RerunGraphs as the engine's CUDA graphs share one memory pool: a graph captured earlier may have freed, as its
    intermediates, the memory a later one's outputs took, so replaying it overwrites them. Here every replay first
    spoils the outputs of every other graph: a caller reading a graph's outputs after another graph ran reads NaN
    and -1."""

    def __init__(self, *args, **kwargs):
        self.spoilable: list = []  # every capture's outputs, each spoiled when another graph replays
        super().__init__(*args, **kwargs)

    def record(self, fn):
        graph, out = super().record(fn)
        self.spoilable.append(out)

        def replay():
            for other in self.spoilable:
                if other is not out:
                    spoil(other)
            graph.replay()

        return SimpleNamespace(replay=replay), out


def rerun_graphs(engine):
    """`engine` with SharedPoolGraphs in place of its graphs (which the CPU has none of); returns it."""
    engine.graphs = SharedPoolGraphs(engine.model, engine.cache, engine.options)
    return engine
