"""Elementwise chains fused by torch.compile on CUDA.

A decode step is hundreds of tiny kernels and each costs microseconds even inside a CUDA graph;
compiling the elementwise chains (norms, rotary, SwiGLU) makes each one kernel. CPU runs them eagerly,
so CI needs no compiler.
"""
import functools

import torch

ENABLED = {"cuda": True}  # EngineOptions(compile=False) switches it off


def cuda_compiled(fn):
    compiled = torch.compile(fn, dynamic=True, fullgraph=True)

    @functools.wraps(fn)
    def run(x, *args, **kwargs):
        return (compiled if x.is_cuda and ENABLED["cuda"] else fn)(x, *args, **kwargs)
    return run
