"""An experiment: layers.gemv's one-row read with the weight tiles streamed through a TMA ring in shared memory.

layers.gemv holds its weight tiles in registers (one or two ahead of their use), so a program keeps few bytes in
flight, and the persistent forms tried since were register-bound (reports/performance-history.md, eighteenth and
twenty-third sessions). Here the weight is read through a Hopper tensor descriptor in a `tl.range(...,
num_stages=STAGES)` loop, which Triton (3.6 as on the H200, and 3.9) compiles to a ring of STAGES tiles loaded by
TMA and handed over by mbarriers: STAGES - 1 tiles in flight at a fraction of layers.gemv's registers (`python -m
pocketlab.layers.gemv_sweep --resources` compiles both; `--tma-chain` times them in a decode-like chain). Same
arithmetic as layers.gemv's plain and residual epilogues: float32 lanes along K, summed once, rounded once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import pdl
from .invariant.matmul import finish
from .pdl import wait_then_release


@dataclass(frozen=True)
class Ring:
    """BLOCK_N weight rows a program, BLOCK_K-wide tiles (a TMA box spans at most 256 elements a side), STAGES tiles
    in the ring."""

    block_n: int = 4
    block_k: int = 256
    stages: int = 4
    num_warps: int = 4


@triton.jit
def _gemv_tma(x_ptr, w_desc, y_ptr, res_ptr, N, K, RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """y[n] = sum_k W[n, k] x[k] for this program's BLOCK_N rows (the descriptor zero-fills past N and K), then
    layers.gemv's epilogue (RESIDUAL 1: res[n] + y, rounded where it rounds)."""
    n0 = tl.program_id(0) * BLOCK_N
    wait_then_release(PDL)
    lanes = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        lanes += w_desc.load([n0, k0]).to(tl.float32) * x[None, :]
    n, m = n0 + tl.arange(0, BLOCK_N), tl.arange(0, 1)
    total = tl.sum(lanes, 1)[None, :]
    y = finish(total, total, res_ptr, res_ptr, m, n, m < 1, n < N, 0, y_ptr.dtype.element_ty, False, RESIDUAL)
    tl.store(y_ptr + n[None, :], y, mask=(n < N)[None, :])


def gemv_tma(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None, ring: Ring = Ring()):
    """F.linear(x, weight) (+ residual) for one row x [1, K] or [K], weight [N, K] row-major with 16-byte aligned
    rows (TMA's rule); rounded once to x's dtype."""
    N, K = weight.shape
    aligned = weight.data_ptr() % 16 == 0 and (weight.stride(0) * weight.element_size()) % 16 == 0
    if x.numel() != K or weight.stride(1) != 1 or not aligned:
        raise ValueError(f"gemv_tma: one row of {K} against a row-major [N, K] weight with 16-byte aligned rows; got "
                         f"x {tuple(x.shape)}, weight {tuple(weight.shape)} strides {weight.stride()}")  # fmt: skip
    if residual is not None and residual.numel() != N:
        raise ValueError(f"gemv_tma: residual {tuple(residual.shape)} should hold the output's {N} values")
    y = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    desc = TensorDescriptor.from_tensor(weight, block_shape=[ring.block_n, ring.block_k])
    _gemv_tma[(triton.cdiv(N, ring.block_n),)](
        x.reshape(K), desc, y, y if residual is None else residual.reshape(N), N, K, RESIDUAL=residual is not None,
        BLOCK_N=ring.block_n, BLOCK_K=ring.block_k, STAGES=ring.stages, num_warps=ring.num_warps,
        **pdl.launch(x.device),
    )  # fmt: skip
    return y
