"""Elementwise chains fused by torch.compile, inside captured CUDA-graph decode steps only.

A decode step is hundreds of tiny kernels and each costs microseconds even inside a CUDA graph;
compiling the elementwise chains (norms, rotary, SwiGLU, the split-softmax merge) makes each one kernel.
Outside a graph the opposite holds: a compiled call costs far more host time than the few eager kernels
it replaces, so everything else, and the CPU, runs eagerly. Each call site (dtype, strides, batch of one or
more) is its own compiled variant: the recompile limit is raised for that, and past it dynamo runs the
function eagerly instead of failing.
"""

import contextlib
import functools

import torch
import torch._dynamo

_state = {"on": False}
for _name in ("recompile_limit", "cache_size_limit"):
    if hasattr(torch._dynamo.config, _name):
        setattr(torch._dynamo.config, _name, max(getattr(torch._dynamo.config, _name), 64))


@contextlib.contextmanager
def compiled_kernels(enabled: bool = True):
    """Within this block, CUDA calls of the functions below run their compiled form (graph capture)."""
    before, _state["on"] = _state["on"], enabled
    try:
        yield
    finally:
        _state["on"] = before


def compiled_in_graphs(fn):
    """fn, run in its compiled form on CUDA inside `compiled_kernels()` (graph capture), eagerly elsewhere."""
    compiled = torch.compile(fn, dynamic=True)

    @functools.wraps(fn)
    def run(x, *args, **kwargs):
        return (compiled if _state["on"] and x.is_cuda else fn)(x, *args, **kwargs)

    return run
