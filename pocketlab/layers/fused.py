"""Elementwise chains fused by torch.compile on CUDA.

A decode step is hundreds of tiny kernels and each costs microseconds even inside a CUDA graph;
compiling the elementwise chains (norms, rotary, SwiGLU) makes each one kernel. CPU runs them eagerly,
so CI needs no compiler. Each call site (dtype, strides, batch of one or more) is its own compiled
variant: the recompile limit is raised for that, and past it dynamo runs the function eagerly
(fullgraph=False) instead of failing.
"""
import functools

import torch
import torch._dynamo

ENABLED = {"cuda": True}  # EngineOptions(compile=False) switches it off (process-wide)
for _name in ("recompile_limit", "cache_size_limit"):
    if hasattr(torch._dynamo.config, _name):
        setattr(torch._dynamo.config, _name, max(getattr(torch._dynamo.config, _name), 64))


def cuda_compiled(fn):
    compiled = torch.compile(fn, dynamic=True)

    @functools.wraps(fn)
    def run(x, *args, **kwargs):
        return (compiled if x.is_cuda and ENABLED["cuda"] else fn)(x, *args, **kwargs)
    return run
