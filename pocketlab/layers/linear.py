"""A projection with what runs around it: the RMSNorm of its input before, the residual add or SwiGLU after.

`composed` runs them as separate steps (torch, or whatever kernels it is handed); the Triton kernel of
layers.invariant.matmul runs the matmul and the add or SwiGLU in one launch, which at few rows (decode) saves
those kernels (and cuBLAS's split-K reduction) and their gaps between the weight-streaming matmuls.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from . import activations, matmul_tma

FUSED_MAX_ROWS = 64  # the default kernels fuse at up to this many rows (decode batches); cuBLAS beyond
GEMV_MAX_BYTES = 128 << 20  # larger weights stream faster through the fused matmul's deeper pipeline or cuBLAS


def composed(
    matmul,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
    swiglu: bool = False,
    norm=None,
    conv=None,
    activation=activations.swiglu,
) -> torch.Tensor:
    """[residual +] matmul(x, weight, bias), or with `swiglu` silu(gate) * up of the [gate | up] output; with `norm`
    (a layers.norm.RMSNorm) the matmul reads norm(x); `conv` (a linear_decode.ConvStep) then runs on the output's
    first columns."""
    if norm is not None:
        x = norm(x)
    y = matmul(x, weight, bias)
    if swiglu:
        y = activation(y)
    y = y if residual is None else residual + y
    return y if conv is None else conv(y)


linear = functools.partial(composed, F.linear)


def fused_at_few_rows(fused, gemv=None, gemv_rows: int = 0):
    """The default engine's linear: `gemv` (weight rows streamed once, the input's norm computed in the same launch)
    for projections of up to `gemv_rows` rows and GEMV_MAX_BYTES of row-major weight; on sm_90 the few-row matmul's
    TMA form (layers.matmul_tma) for the other calls of few rows it takes; `fused` (the Triton matmul) where the rows
    are few and it has an epilogue to fuse (residual add, SwiGLU), `linear` (cuBLAS and torch) everywhere else; those
    read a norm run first as its own kernel (the ring none, after a residual epilogue that left its rows' squares),
    and run a conv after."""

    def run(x, weight, bias=None, *, residual=None, swiglu=False, norm=None, conv=None):
        rows = x.numel() // x.shape[-1]
        if rows <= gemv_rows and streams_as_gemv(weight) and weight.stride(-1) == 1:
            kernel = gemv
        elif (
            x.element_size() == 2  # TMA's 16-bit dots
            and (ring := matmul_tma.ring_for(rows, x.device))
            and ring.takes(rows, residual is not None or swiglu)
        ):
            kernel = functools.partial(matmul_tma.linear, ring=ring)
        elif (residual is not None or swiglu) and rows <= FUSED_MAX_ROWS:
            kernel = fused
        else:
            kernel = linear
        return kernel(x, weight, bias, residual=residual, swiglu=swiglu, norm=norm, conv=conv)

    return run


def streams_as_gemv(weight: torch.Tensor) -> bool:
    """Whether `fused_at_few_rows` sends this weight's calls of up to gemv_rows rows to the GEMV (by its size)."""
    return weight.numel() * weight.element_size() <= GEMV_MAX_BYTES
