"""Elementwise chains fused by torch.compile, inside captured CUDA-graph decode steps and long prompts.

A decode step is hundreds of tiny kernels and each costs microseconds even inside a CUDA graph;
compiling the elementwise chains (norms, rotary, SwiGLU) makes each one kernel.
Outside a graph the opposite holds for a decode step: a compiled call costs far more host time than the few
eager kernels it replaces; in a long prompt's forward the eager chains' round trips through memory dominate, so
there the large calls run compiled too. Everything else, and the CPU, runs eagerly. Each call site (dtype,
strides, batch of one or more) is its own compiled variant: the recompile limit is raised for that, and past it
dynamo runs the function eagerly instead of failing.
"""

import contextlib
import functools

import torch
import torch._dynamo

_state = {"on": False, "min_elements": 0}
LARGE = 1 << 23  # elements (16 MiB in bf16): here a compiled call's host cost is far below what its eager kernels move
for _name in ("recompile_limit", "cache_size_limit"):
    if hasattr(torch._dynamo.config, _name):
        setattr(torch._dynamo.config, _name, max(getattr(torch._dynamo.config, _name), 64))


@contextlib.contextmanager
def compiled_kernels(enabled: bool = True, min_elements: int = 0):
    """Within this block, CUDA calls of the functions below on at least `min_elements` elements run their compiled
    form: every call inside a graph capture; in an eager prompt forward (min_elements=LARGE) the big ones, where
    the eager chain's round trips through memory cost more than the call."""
    before = dict(_state)
    _state.update(on=enabled, min_elements=min_elements)
    try:
        yield
    finally:
        _state.update(before)


def compiled_in_graphs(fn):
    """fn, run in its compiled form on CUDA inside `compiled_kernels()`, eagerly elsewhere."""
    compiled = torch.compile(fn, dynamic=True)

    @functools.wraps(fn)
    def run(x, *args, **kwargs):
        big = x.numel() >= _state["min_elements"]
        return (compiled if _state["on"] and x.is_cuda and big else fn)(x, *args, **kwargs)

    return run
