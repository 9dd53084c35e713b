"""Programmatic dependent launch: our decode kernels start while the kernel before them is still finishing.

A decode step at small shapes is ~200 short kernels, and each one's launch, block dispatch and first DRAM reads
sit idle behind the previous kernel's tail. Launched with PDL (Hopper and later), a kernel's programs may be
scheduled as soon as every program of the previous kernel has started; they read what no kernel writes (weights)
and then `wait()`: it returns once the previous kernel has finished and its writes are visible, so every read of an
activation and every write comes after it. Each kernel then calls `release()`, letting the next one launch, but not
the one after it (one kernel ahead at most). Kernels without PDL (cuBLAS, torch) keep the usual full ordering, and
the order is transitive: a kernel's end implies its predecessor's. So a kernel may also read before its wait what
a kernel two or more launches back wrote (the MoE experts' ids when the shared expert runs between).

POCKETLAB_PDL=0 turns it off (to measure it); the interpreter (CPU) never uses it.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:
    from triton.backends.nvidia.compiler import CUDAOptions
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    SUPPORTED = "launch_pdl" in CUDAOptions.__dataclass_fields__
except ImportError:  # a Triton without grid dependency control
    SUPPORTED = False
    gdc_wait = gdc_launch_dependents = None


@functools.cache
def _on(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def sm90(device: torch.device) -> bool:
    """Whether `device` is a CUDA GPU of compute capability 9.0 or later (Hopper's PDL, TMA, bulk L2 prefetch)."""
    return device.type == "cuda" and _on(device.index if device.index is not None else torch.cuda.current_device())


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: CUDA sm_90+, a Triton that has it, POCKETLAB_PDL not 0."""
    return SUPPORTED and os.environ.get("POCKETLAB_PDL", "1") != "0" and sm90(device)


def launch(device: torch.device) -> dict:
    """The launch keywords and the PDL constexpr for a kernel on `device`: pass as **launch(device)."""
    return {"launch_pdl": True, "PDL": True} if enabled(device) else {"PDL": False}


@triton.jit
def wait_then_release(PDL: tl.constexpr):
    """Before a kernel's first read of an activation or first write: wait for the previous kernel, then let the
    next one launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
