"""y = x @ W^T for a few rows (decode), streaming each weight row once, with the input's RMSNorm and the residual
add or SwiGLU in the launch.

At one to a few rows a projection is a weight read: a matmul kernel pads the rows to a tensor-core tile and, to fill
the GPU, splits K and adds the slices' partials after an arrival count, a chain of global round trips that costs
more than the read itself at the small shapes. Here each program owns BLOCK_N whole weight rows: it walks K in
BLOCK_K-wide tiles, multiplies each by every input row into float32 lanes, and sums the lanes once at the end.
No split, no second pass, no atomics; the epilogue is the matmul kernel's (`matmul.finish`).

A pre-norm folds in for free: every program walks the whole input row, so it sums the row's squares on the way and
multiplies by the norm's weight as it loads x; since rms(x) is one scalar per row, W @ (g * x / rms(x)) is
(W @ (g * x)) / rms(x), applied to the fp32 sums before the epilogue. The normed row itself is never rounded to the
dtype (the unfused norm rounds it once or twice): a difference the size of that rounding, in the exact direction.

Every row is reduced the same way whatever the other rows hold: with the same launch (ROWS, the tile), each of up
to ROWS rows gets the same bits in any batch (the default engine takes it for single rows: decode at batch 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..config import GEMV_MAX_ROWS as MAX_ROWS
from . import conv_epilogue, gemv_tma, pdl
from .invariant.matmul import PLAIN, as_rows, checked_width, epilogue_of, finish
from .norm import norm_flavour
from .pdl import wait_then_release


@dataclass(frozen=True)
class Launch:
    """How one launch covers [rows, N]: ROWS rows per program (rows <= ROWS), BLOCK_N weight rows, BLOCK_K."""

    rows: int
    block_n: int
    block_k: int
    num_warps: int
    ahead: int = 1  # weight tiles in flight beyond the one in use (1 or 2), the first `ahead` before the PDL wait


def launch_for(M: int, N: int, K: int, device: torch.device, normed: bool = False) -> Launch:
    """The interpreter keeps one small tile (tails in both directions at test shapes). On the GPU, from the H200
    sweep (reports/gpu/gemv-sweep-h200.txt): one row reads fastest in 1,024-wide tiles of 2 weight rows when N is
    small (K long), else 512-wide tiles of 4 (2 while N <= 3,072); several rows (their lanes multiply the registers)
    in 256-wide tiles of 4. A wide normed projection (`normed`: qkv, the Gated DeltaNet in_proj) takes tiles of 8
    rows, so each program's loads of the x row and the norm weight serve twice the weight rows: 256 wide, and 512
    where N passes 8,192 with K of 2,048 and more (the in_proj of 9B and 35B-A3B: 2-6% faster on the H100 and the
    H200, reports/gpu/gemv-norm-chain-*.txt). A weight of at most 8 MiB, N >= 1,024 and a long K (o_proj, down at
    0.6B) takes 1,024-wide tiles of 4 rows, two tiles ahead: the program's whole read is issued before the PDL
    wait; the fastest there in both sweeps of every tile with one or two ahead (gemv-forms-sweep-h200.txt,
    gemv-persistent-sweep-h200.txt)."""
    if M > MAX_ROWS:
        raise ValueError(f"gemv: {M} rows; it takes at most {MAX_ROWS}")
    rows = triton.next_power_of_2(M)
    if device.type != "cuda":
        return Launch(rows, 8, 64, 4)
    if rows > 1:
        return Launch(rows, 4, min(256, triton.next_power_of_2(K)), 4)
    if normed and N > 3072:
        return Launch(1, 8, 512 if N > 8192 and K >= 2048 else min(256, triton.next_power_of_2(K)), 4)
    if N >= 1024 and N * K * 2 <= 8 << 20 and K >= 2048:
        return Launch(1, 4, 1024, 4, ahead=2)
    block_k = min(1024 if N <= 1024 else 512, triton.next_power_of_2(K))
    return Launch(1, 2 if N <= 3072 and K > 512 else 4, block_k, 4)


@triton.jit
def _tile(rows, k, live_n, K):
    """The weight rows' columns k (zeros past K)."""
    return tl.load(rows + k[None, :], mask=live_n[:, None] & (k < K)[None, :], other=0.0)


@triton.jit(do_not_specialize=["rows"])
def _gemv(x_ptr, w_ptr, b_ptr, y_ptr, res_ptr, g_ptr, eps, rows, N, K, stride_xm, stride_wn, stride_ym, stride_rm,
          slot_ptr, conv_ptr, into_ptr, into_row_ptr, cw_ptr, C, stride_cs, stride_cc, HAS_BIAS: tl.constexpr,
          EPILOGUE: tl.constexpr, NORM: tl.constexpr, CONV_K: tl.constexpr, TAPS: tl.constexpr, ROWS: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, AHEAD: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """y[m, n] for the ROWS rows and this program's BLOCK_N columns: float32 lanes [ROWS, BLOCK_N, BLOCK_K] along
    K, summed once. NORM: x is first RMS-normed with weight g (see the module docstring). EPILOGUE 1: y = residual +
    x @ W^T; 2: W is [gate | up] (2N rows), y = silu(x @ gate^T) * (x @ up^T). CONV_K: then the causal conv of width
    CONV_K (TAPS: its power of two) on the first C columns, each row's window in slot slot_ptr[m], moved to row
    into_row_ptr[m] of into_ptr (layers.conv_epilogue). Each weight tile is loaded AHEAD steps before its use, the first
    AHEAD before the PDL wait (weights are never written), so the read streams while the previous kernel finishes."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, ROWS)
    live_m, live_n = m < rows, n < N
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    up_rows = w_rows + N * stride_wn
    TWO: tl.constexpr = EPILOGUE == 2
    k = tl.arange(0, BLOCK_K)
    w = _tile(w_rows, k, live_n, K)
    up = _tile(up_rows, k, live_n, K) if TWO else w
    w1, up1 = w, up  # the second tile ahead (unused at AHEAD 1)
    if AHEAD == 2:
        w1 = _tile(w_rows, k + BLOCK_K, live_n, K)
        up1 = _tile(up_rows, k + BLOCK_K, live_n, K) if TWO else w1
    g = tl.load(g_ptr + k, mask=k < K, other=0.0) if NORM else k  # the norm's weight: ahead like the others
    wait_then_release(PDL)
    if CONV_K:
        taps, cells, window = conv_epilogue.operands(m, n, live_m, slot_ptr, conv_ptr, into_ptr, into_row_ptr, cw_ptr,
                                                     C, stride_cs, stride_cc, CONV_K, TAPS)  # fmt: skip
    lanes = tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
    lanes_up = tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
    squares = tl.zeros((ROWS, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        w_next = _tile(w_rows, k + AHEAD * BLOCK_K, live_n, K)
        up_next = _tile(up_rows, k + AHEAD * BLOCK_K, live_n, K) if TWO else w_next
        x = tl.load(x_rows + k[None, :], mask=live_m[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)
        if NORM:
            g_next = tl.load(g_ptr + k + BLOCK_K, mask=k + BLOCK_K < K, other=0.0)
            squares += x * x
            x = x * (g.to(tl.float32) + (1.0 if NORM == 2 else 0.0))[None, :]
            g = g_next
        lanes += x[:, None, :] * w.to(tl.float32)[None, :, :]
        if TWO:
            lanes_up += x[:, None, :] * up.to(tl.float32)[None, :, :]
        if AHEAD == 2:
            w, up, w1, up1 = w1, up1, w_next, up_next
        else:
            w, up = w_next, up_next
    total, total_up = tl.sum(lanes, axis=2), tl.sum(lanes_up, axis=2)
    if NORM:
        inv_rms = tl.rsqrt(tl.sum(squares, axis=1) / K + eps)[:, None]
        total, total_up = total * inv_rms, total_up * inv_rms
    dtype = y_ptr.dtype.element_ty
    y = finish(total, total_up, b_ptr, res_ptr, m, n, live_m, live_n, stride_rm, dtype, HAS_BIAS, EPILOGUE)
    if CONV_K:
        y = conv_epilogue.apply(y, n, live_m, taps, cells, window, C, CONV_K, TAPS)
    tl.store(y_ptr + m.to(tl.int64)[:, None] * stride_ym + n[None, :], y, mask=live_m[:, None] & live_n[None, :])


# A conv rides in the epilogue of rows at least this long. At Qwen3.5-0.8B's in_proj (K 1,024: four K steps a
# program) the epilogue cost more than the launch it saves; at 9B and 35B-A3B (K 4,096 and 2,048) it gains
# (reports/gpu/ab-conv-fold-*-h200.txt). The one-row TMA ring, which the 0.8B's in_proj takes on sm_90, folds it at
# every K (gemv_tma.folds_conv). The interpreter takes every K, so the tests reach the epilogue.
CONV_MIN_K = 2048


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         residual: torch.Tensor | None = None, swiglu: bool = False, norm=None, conv=None) -> torch.Tensor:  # fmt: skip
    """F.linear(x, weight, bias) for x [..., K] of at most MAX_ROWS rows, weight [N, K] (contiguous rows), bias [N];
    fp32 sums rounded once. `residual` [..., N]: residual + y; `swiglu`: weight is [gate | up] and y [..., N] is
    silu(x @ gate^T) * (x @ up^T). The same arguments and rounding as layers.invariant.linear; `norm` (a
    layers.norm.RMSNorm of width K) is applied to x inside the launch, and `conv` (a linear_decode.ConvStep) to y's
    first columns after it."""
    N = checked_width("gemv", x, weight, bias, residual, swiglu)
    if weight.stride(1) != 1:
        raise ValueError(f"gemv: weight {tuple(weight.shape)} should be row-major (unit stride along K)")
    K = weight.shape[1]
    if norm is not None and tuple(norm.weight.shape) != (K,):
        raise ValueError(f"gemv: norm weight {tuple(norm.weight.shape)} should be [{K}], the input's width")
    x2 = as_rows(x, K)
    _check_conv(conv, x2.shape[0], N)
    y = torch.empty(x2.shape[0], N, dtype=x.dtype, device=x.device)
    res = None if residual is None else as_rows(residual, N)
    ring = gemv_tma.one_row_ring(weight) if x2.shape[0] == 1 else None
    folds_conv = gemv_tma.folds_conv() if ring else K >= CONV_MIN_K or not x.is_cuda
    inside, after = (conv, None) if folds_conv else (None, conv)  # the conv in the launch's epilogue, or after it
    if ring:  # the weight streamed through a TMA ring (layers.gemv_tma)
        gemv_tma.launch(x2, weight, bias, y, ring, epilogue_of(residual, swiglu), res, norm, inside)
    elif x2.shape[0]:
        t = launch_for(x2.shape[0], N, K, x.device, normed=norm is not None and not swiglu)
        launch(x2, weight, bias, y, t, epilogue_of(residual, swiglu), res, norm, inside)
    y = y.reshape(*x.shape[:-1], N)
    return y if after is None else after(y)


def _check_conv(conv, rows: int, N: int) -> None:
    """A ValueError unless `conv` (a linear_decode.ConvStep) fits an output of `rows` rows and N columns."""
    if conv is None:
        return
    fits = conv.channels <= N and conv.slot_ids.shape == (rows,)
    if not (fits and conv.state.stride(-1) == 1 and conv.weight.is_contiguous()):
        raise ValueError(
            f"gemv: a conv of {conv.channels} channels over {tuple(conv.slot_ids.shape)} slots (windows and taps "
            f"contiguous) does not fit an output of {rows} rows and {N} columns"
        )


def launch(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor, t: Launch,
           epilogue: int = PLAIN, residual=None, norm=None, conv=None) -> torch.Tensor:  # fmt: skip
    """y[M, N] = x2 @ weight^T (+ bias, + the epilogue; of norm(x2) with a norm; conv'd with a conv) with launch `t`
    (the sweep tries others)."""
    M, K = x2.shape
    N = y.shape[1]
    conv_args, conv_widths = conv_epilogue.arguments(conv, y)
    _gemv[(triton.cdiv(N, t.block_n),)](
        x2, weight, y if bias is None else bias, y, y if residual is None else residual,
        y if norm is None else norm.weight, 0.0 if norm is None else norm.eps, M, N, K, x2.stride(0),
        weight.stride(0), y.stride(0), 0 if residual is None else residual.stride(0), *conv_args,
        HAS_BIAS=bias is not None, EPILOGUE=epilogue, NORM=norm_flavour(norm), **conv_widths, ROWS=t.rows,
        BLOCK_N=t.block_n, BLOCK_K=t.block_k, AHEAD=t.ahead, num_warps=t.num_warps,
        **pdl.launch(x2.device),
    )  # fmt: skip
    return y
