"""layers.gemv's one-row read with the weight tiles streamed through a TMA ring in shared memory.

layers.gemv holds its weight tiles in registers (one or two ahead of their use), so a program keeps few bytes in
flight, and the persistent forms tried since were register-bound (reports/performance-history.md, eighteenth and
twenty-third sessions). Here the weight is read through a Hopper tensor descriptor in a `tl.range(...,
num_stages=STAGES)` loop, which Triton (3.6 as on the H200, and 3.9) compiles to a ring of STAGES tiles loaded by
TMA and handed over by mbarriers: STAGES - 1 tiles in flight at a fraction of layers.gemv's registers (`python -m
pocketlab.layers.gemv_sweep --resources` compiles both; `--tma-chain` times them in a decode-like chain). Same
arithmetic as layers.gemv at one row (its norm, bias and epilogues: float32 lanes along K, summed once, rounded once).
layers.gemv sends its one-row calls here for the small weights where the ring was faster in the engine (`one_row_ring`);
`POCKETLAB_GEMV_TMA` overrides that, to measure.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import conv_epilogue, pdl
from .invariant.matmul import PLAIN, finish
from .norm import norm_flavour
from .pdl import wait_then_release


@dataclass(frozen=True)
class Ring:
    """BLOCK_N weight rows a program, BLOCK_K-wide tiles (a TMA box spans at most 256 elements a side), STAGES tiles
    in the ring."""

    block_n: int = 4
    block_k: int = 256
    stages: int = 4
    num_warps: int = 4


DEFAULT_RING = Ring()
# One-row GEMVs of weights up to RING_MAX_BYTES, rows up to RING_MAX_K long and at least RING_MIN_N of them take
# this ring on Hopper: every one-row GEMV of Qwen3-0.6B and Qwen3.5-0.8B (4-16 MiB weights, N >= 1,024, K <= 3,584)
# through it was faster in every paired round of two runs, at 8B (32 MiB and up) slower in every one
# (reports/gpu/ab-gemv-tma-paired-*); a third run at 0.6B saw no difference (ab-ring-default-*). The MoE shapes'
# 16 MiB o_proj and out_proj (K 4,096: a ring program walks 16 tiles) read faster through layers.gemv
# (ab-moe-attn-ring-*), and so do their routers (N 129 and 257: 17 and 33 programs of 8 rows leave most SMs idle;
# with them left on the ring a step took 7-9% longer than with the ring off, ab-ring-rule-*).
ONE_ROW_RING = Ring(8, 256, 6)
RING_MAX_BYTES = 24 << 20
RING_MAX_K = 3584
RING_MIN_N = 1024


def ring_from_env(name: str = "POCKETLAB_GEMV_TMA", unset=None, kind=Ring):
    """The switch `name`: unset or "", `unset`; "0", the kernels' own launches (None); "1", `kind`'s default ring;
    "a:b:c" (or with commas), kind(a, b, c). For measuring (tools.ab, whose variants are comma-separated)."""
    value = os.environ.get(name, "")
    if value in ("", "0"):
        return None if value else unset
    return kind() if value == "1" else launch_of(value, kind)


def launch_of(text: str, kind):
    """kind(a, b, c) from "a:b:c" (or "a,b,c"): a ring or launch written as its fields' integers."""
    return kind(*(int(v) for v in text.replace(":", ",").split(",")))


def one_row_ring(weight: torch.Tensor) -> Ring | None:
    """The ring for a one-row GEMV of `weight`, or None for layers.gemv's own launch: ONE_ROW_RING for weights of
    at most RING_MAX_BYTES, rows of at most RING_MAX_K and at least RING_MIN_N rows on a GPU with TMA (sm_90 and
    later), unless POCKETLAB_GEMV_TMA says otherwise (the interpreter takes a ring only when it does)."""
    (N, K), nbytes = weight.shape, weight.numel() * weight.element_size()
    small = nbytes <= RING_MAX_BYTES and K <= RING_MAX_K and N >= RING_MIN_N
    ring = ring_from_env(unset=ONE_ROW_RING if small and has_tma(weight.device) else None)
    return ring if ring and fits(weight) else None


def fits(matrix: torch.Tensor) -> bool:
    """TMA reads rows of 16-byte multiples from a 16-byte aligned start (a weight, or matmul_tma's x)."""
    row_bytes = matrix.stride(0) * matrix.element_size()
    return matrix.stride(1) == 1 and matrix.data_ptr() % 16 == 0 and row_bytes % 16 == 0


def folds_conv() -> bool:
    """Whether a one-row ring runs the Gated DeltaNet's decode conv in its epilogue: one launch fewer a layer, faster
    in every paired round at 0.8B b1 (reports/gpu/ab-ring-conv-*); POCKETLAB_RING_CONV=0 runs the conv after it."""
    return os.environ.get("POCKETLAB_RING_CONV", "1") != "0"


def has_tma(device: torch.device) -> bool:
    """Hopper (sm_90) and later read through tensor descriptors (pdl.sm90 caches the capability)."""
    return pdl.sm90(device)


@triton.jit
def ring_sums(desc, row, up_row, x_ptr, g_ptr, K, first, first_up, NORM: tl.constexpr, TWO: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):  # fmt: skip
    """(x . the rows from `row`, x . the rows from `up_row` when TWO, the sum of x's squares) over K: `first` and
    `first_up` are the rows' first tiles (the caller may load them before its PDL wait, as layers.gemv does), the
    rest is read through `desc`'s ring of STAGES tiles (zeros past the weight's end); NORM (layers.gemv's flavours):
    x times the norm's weight g on the way."""
    k = tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
    squares = x * x
    if NORM:
        x = x * (tl.load(g_ptr + k, mask=k < K, other=0.0).to(tl.float32) + (1.0 if NORM == 2 else 0.0))
    lanes = first.to(tl.float32) * x[None, :]
    lanes_up = first_up.to(tl.float32) * x[None, :] if TWO else tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        if NORM:
            squares += x * x
            x = x * (tl.load(g_ptr + k, mask=k < K, other=0.0).to(tl.float32) + (1.0 if NORM == 2 else 0.0))
        lanes += desc.load([row, k0]).to(tl.float32) * x[None, :]
        if TWO:
            lanes_up += desc.load([up_row, k0]).to(tl.float32) * x[None, :]
    return tl.sum(lanes, 1), tl.sum(lanes_up, 1), tl.sum(squares, 0)


@triton.jit
def _gemv_tma(x_ptr, w_desc, b_ptr, y_ptr, res_ptr, g_ptr, eps, N, K, slot_ptr, conv_ptr, into_ptr, into_row_ptr,
              cw_ptr, C, stride_cs, stride_cc, HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr, NORM: tl.constexpr,
              CONV_K: tl.constexpr, TAPS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              STAGES: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """layers.gemv's one-row arithmetic for this program's BLOCK_N rows: NORM, x RMS-normed with weight g on the way;
    EPILOGUE 1, residual + y; 2, W is [gate | up] (up rows N further; the gate tile of a block past N reads up rows,
    never stored) and y = silu(gate) * up; CONV_K, then the decode conv on the first C columns (layers.conv_epilogue,
    its taps and the row's window read before the wait: this layer's conv wrote the window a step before)."""
    n0 = tl.program_id(0) * BLOCK_N
    n, m = n0 + tl.arange(0, BLOCK_N), tl.arange(0, 1)
    first = w_desc.load([n0, 0])  # the first tiles before the wait: weights, which no kernel writes
    first_up = w_desc.load([n0 + N, 0]) if EPILOGUE == 2 else first
    if CONV_K:
        taps, cells, window = conv_epilogue.operands(m, n, m < 1, slot_ptr, conv_ptr, into_ptr, into_row_ptr, cw_ptr,
                                                     C, stride_cs, stride_cc, CONV_K, TAPS)  # fmt: skip
    wait_then_release(PDL)
    total, total_up, squares = ring_sums(w_desc, n0, n0 + N, x_ptr, g_ptr, K, first, first_up, NORM, EPILOGUE == 2,
                                         BLOCK_N, BLOCK_K, STAGES)  # fmt: skip
    inv_rms = tl.rsqrt(squares / K + eps) if NORM else 1.0
    y = finish((total * inv_rms)[None, :], (total_up * inv_rms)[None, :], b_ptr, res_ptr, m, n, m < 1, n < N, 0,
               y_ptr.dtype.element_ty, HAS_BIAS, EPILOGUE)  # fmt: skip
    if CONV_K:
        y = conv_epilogue.apply(y, n, m < 1, taps, cells, window, C, CONV_K, TAPS)
    tl.store(y_ptr + n[None, :], y, mask=(n < N)[None, :])


def launch(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor, ring: Ring,
           epilogue: int = PLAIN, residual: torch.Tensor | None = None, norm=None,
           conv=None) -> torch.Tensor:  # fmt: skip
    """y [1, N] from x2 [1, K] as layers.gemv.launch computes it (its checks done by the caller; `fits(weight)`),
    the weight read through a `ring`."""
    N, K = y.shape[1], x2.shape[1]
    desc = TensorDescriptor.from_tensor(weight, block_shape=[ring.block_n, ring.block_k])
    conv_args, conv_widths = conv_epilogue.arguments(conv, y)
    _gemv_tma[(triton.cdiv(N, ring.block_n),)](
        x2, desc, y if bias is None else bias, y, y if residual is None else residual,
        y if norm is None else norm.weight, 0.0 if norm is None else norm.eps, N, K, *conv_args,
        HAS_BIAS=bias is not None, EPILOGUE=epilogue, NORM=norm_flavour(norm), **conv_widths, BLOCK_N=ring.block_n,
        BLOCK_K=ring.block_k, STAGES=ring.stages, num_warps=ring.num_warps, **pdl.launch(x2.device),
    )  # fmt: skip
    return y
