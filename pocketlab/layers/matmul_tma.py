"""The few-row matmul (decode batches of up to 64 rows) with the weight streamed through a TMA ring, as W @ x^T.

The invariant matmul's few-row tiles put x's rows on the dot's first side ([rows, 64 weight rows]), so on Hopper its
16- and 32-row tiles run the warp-level MMA and load the weight by threads, below cuBLAS's skinny kernels at 32 rows
(reports/gpu/fused-linear-sweep-h200.txt, gemv-resources-sm90-triton3.6.txt). Here the weight is the first operand:
a program's BLOCK_N weight rows times x's rows as columns, [BLOCK_N, BLOCK_M], which Triton runs as warpgroup MMAs
from shared memory fed by a `tl.range(..., num_stages=STAGES)` ring of TMA loads, and the program's first PREFETCH
weight tiles are asked into L2 before its PDL wait. K is cut as the invariant matmul cuts it (its `Order`: the
slices added in slice order by the last of a tile's programs) and the epilogue is its `finish`; on the GPU each
element is the same chain of MMA steps, and the sweep and the engine found the same bits as the invariant kernel's.
Save one rule (`ring_order`): a weight of many tiles whose K is at most `one_slice_k` runs all of K in one slice, its
partial sums and last-arrival reads gone, and so other bits (reports/gpu/ab-one-slice-*).

The default engine sends its calls of up to 64 rows here on sm_90 and later (`ring_for`), save those the GEMV takes
and one-row calls with an epilogue: the lm_head at batch 1 among them, which cuBLAS ran before. POCKETLAB_MATMUL_TMA=0
turns that off, "block_n:stages:prefetch[:plain[:min_rows[:one_slice_k]]]" tries another ring.

The residual epilogue (o_proj, down, out_proj) also leaves each row's sum of squares over its tile of columns beside the
stream it writes, so the next projection, its pre-norm's weight folded in (RMSNorm.fold_into), norms its rows as one
scalar from them: no norm launch between the two (`carried_squares`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import gemv_tma, pdl
from .arrivals import arrival_counts
from .invariant.dot import dot, precision
from .invariant.matmul import SWIGLU, Fused, Order, as_rows, checked_width, epilogue_of, finish, last_sums, order
from .invariant.matmul import linear as invariant_linear
from .pdl import wait_then_release
from .prefetch import bulk_prefetch

MAX_ROWS = 64
ONE_SLICE_TILES = 64  # tiles a weight needs to run in one slice: about half an H100's or H200's SMs busy
SHARED_BYTES = 224 << 10  # of an H100's or H200's 227 KiB a program may hold: the ring's stages must fit in it


@dataclass(frozen=True)
class Ring:
    """BLOCK_N weight rows a program (the MMA's M side), STAGES tiles in the ring, PREFETCH first tiles into L2
    before the PDL wait; `plain`: projections without an epilogue take it too (else cuBLAS's); calls with an
    epilogue take it from `min_rows` rows (else the invariant matmul's); `one_slice_k`: K not cut where short
    (`ring_order`: other bits than the invariant matmul's)."""

    block_n: int = 64
    stages: int = 4
    prefetch: int = 2
    plain: bool = True
    min_rows: int = 2
    one_slice_k: int = 0  # K up to which a weight of many tiles runs in one slice (`ring_order`)

    def takes(self, rows: int, epilogue: bool) -> bool:
        return rows >= self.min_rows if epilogue else self.plain


# One-row calls with an epilogue (8B's, 9B's gate_up) were about 1% faster in the fused matmul. One slice up to a K of
# 1,024 (the 0.6B's and 0.8B's projections from the hidden state): 0.6B faster at 8 and 32 rows, 0.8B at 32, in every
# paired round; at a K of 4,096 (8B, 9B) slower at 8 rows and even at 32 (reports/gpu/ab-one-slice-*-h100.txt).
DEFAULT_RING = Ring(one_slice_k=1024)


def ring_for(rows: int, device: torch.device) -> Ring | None:
    """The ring for a few-row matmul of `rows` rows on `device`: DEFAULT_RING up to MAX_ROWS rows on a GPU with TMA
    (sm_90 and later), unless POCKETLAB_MATMUL_TMA says otherwise ("0": none; "block_n:stages:prefetch[:plain
    [:min_rows[:one_slice_k]]]"), for measuring; the interpreter takes a ring only when it says so."""
    if rows > MAX_ROWS:
        return None
    return gemv_tma.ring_from_env("POCKETLAB_MATMUL_TMA", DEFAULT_RING if gemv_tma.has_tma(device) else None, Ring)


def fits(x2: torch.Tensor, weight: torch.Tensor) -> bool:
    """TMA reads rows of 16-byte multiples from 16-byte aligned starts; up to MAX_ROWS rows."""
    sixteen_bits = x2.dtype in (torch.bfloat16, torch.float16)
    return x2.shape[0] <= MAX_ROWS and sixteen_bits and gemv_tma.fits(x2) and gemv_tma.fits(weight)


@triton.jit
def _prefetch_rows(w_ptr, n0, k_start, K, rows_total, stride_wn, ROWS: tl.constexpr, BYTES: tl.constexpr):
    """Ask L2 for BYTES of each of ROWS weight rows from n0, starting at column k_start (one bulk prefetch a row)."""
    r = n0 + tl.arange(0, ROWS)
    size = tl.minimum(tl.maximum((K - k_start) * 2, 0), BYTES)
    size = tl.where(r < rows_total, size, 0).to(tl.int32)
    bulk_prefetch(w_ptr.to(tl.int64) + (r.to(tl.int64) * stride_wn + k_start) * 2, size)


@triton.jit(do_not_specialize=["rows"])
def _matmul_tma(x_desc, w_desc, w_ptr, b_ptr, y_ptr, part_ptr, arrived_ptr, res_ptr, squares_in_ptr,
                squares_out_ptr, rows, N, K, k_per_split, split_k, tiles_in, eps, stride_wn, stride_ym, stride_ps,
                stride_pm, stride_rm, HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr, PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                PREFETCH: tl.constexpr, TILES_IN: tl.constexpr, SQUARES_OUT: tl.constexpr,
                PDL: tl.constexpr):  # fmt: skip
    """Slice program_id(1) of weight rows [BLOCK_N from program_id(0)] times every row of x; EPILOGUE as the
    invariant matmul's (2: W is [gate | up], up rows N further; gate rows past N read up rows, never stored).
    TILES_IN (> 0): x's rows are normed by a unit RMSNorm, their sums of squares read as `tiles_in` partials
    [tiles_in, rows] at squares_in_ptr; SQUARES_OUT: each row's sum of squares over this tile's columns of y is
    stored at squares_out_ptr [program_id(0), rows], for the norm of the projection that reads y next."""
    pid_n, s = tl.program_id(0), tl.program_id(1)
    n0 = pid_n * BLOCK_N
    k_start = s * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    TWO: tl.constexpr = EPILOGUE == 2
    if PREFETCH:  # weights, which no kernel writes: asked for while the kernel before ends
        _prefetch_rows(w_ptr, n0, k_start, K, N * 2 if TWO else N, stride_wn, BLOCK_N, PREFETCH * BLOCK_K * 2)
        if TWO:
            _prefetch_rows(w_ptr, n0 + N, k_start, K, N * 2, stride_wn, BLOCK_N, PREFETCH * BLOCK_K * 2)
    wait_then_release(PDL)
    m = tl.arange(0, BLOCK_M)
    live_m = m < rows
    if TILES_IN:  # the kernel before stored them: read after the wait, summed in tile order, used by the epilogue
        t = tl.arange(0, TILES_IN)
        parts = tl.load(squares_in_ptr + t[:, None] * rows + m[None, :], mask=(t < tiles_in)[:, None] & live_m[None, :],
                        other=0.0)  # fmt: skip
        rstd = tl.rsqrt(tl.sum(parts, 0) / K + eps)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
        x = tl.trans(x_desc.load([0, k0]))  # [BLOCK_K, BLOCK_M]; rows past `rows` and columns past K read zeros
        acc = dot(w_desc.load([n0, k0]), x, acc, PRECISION)
        if TWO:
            acc_up = dot(w_desc.load([n0 + N, k0]), x, acc_up, PRECISION)
    n = n0 + tl.arange(0, BLOCK_N)
    live_n = n < N
    live = live_m[:, None] & live_n[None, :]
    total, total_up = tl.trans(acc), tl.trans(acc_up)  # [BLOCK_M, BLOCK_N]
    done = True
    if split_k > 1:  # the last of the tile's slices adds them all in slice order
        total, total_up, done = last_sums(total, total_up, part_ptr + m[:, None] * stride_pm + n[None, :],
                                          arrived_ptr + pid_n, s, split_k, live, stride_ps, N, TWO)  # fmt: skip
    if done:
        if TILES_IN:  # x's norm as one scalar a row: (rstd x) @ W^T = rstd (x @ W^T), the norm's weight in W
            total, total_up = total * rstd[:, None], total_up * rstd[:, None]
        y = finish(total, total_up, b_ptr, res_ptr, m, n, live_m, live_n, stride_rm, y_ptr.dtype.element_ty,
                   HAS_BIAS, EPILOGUE)  # fmt: skip
        tl.store(y_ptr + m.to(tl.int64)[:, None] * stride_ym + n[None, :], y, mask=live)
        if SQUARES_OUT:  # of y as stored, as the norm would read it
            yf = tl.where(live, y.to(tl.float32), 0.0)
            tl.store(squares_out_ptr + pid_n * rows + m, tl.sum(yf * yf, 1), mask=live_m)


def stages_that_fit(ring: Ring, block_m: int, row_bytes: int, two: bool) -> int:
    """As many of the ring's stages (2 at least) as SHARED_BYTES holds: a stage is a weight tile (two for SwiGLU)
    and x's, `row_bytes` a row."""
    return max(2, min(ring.stages, SHARED_BYTES // ((ring.block_n * (1 + two) + block_m) * row_bytes)))


def ring_order(o: Order, K: int, tiles: int, one_slice_k: int) -> Order:
    """`o`, or one slice of all K where K <= one_slice_k and the weight has at least ONE_SLICE_TILES tiles: enough
    programs without slices, whose partial sums and last-arrival reads cost more than they gain at short K."""
    if K > one_slice_k or tiles < ONE_SLICE_TILES:
        return o
    return Order(o.block_k, 1, triton.cdiv(K, o.block_k) * o.block_k)


SQUARES = "_pocketlab_row_squares"  # the attribute by which a residual epilogue's output carries its rows' squares


def carried_squares(x: torch.Tensor, norm) -> torch.Tensor | None:
    """The partial sums of squares of x's rows ([tiles, rows] fp32) that a unit `norm` (its weight folded into the
    projection) may take instead of its launch: those the ring's residual epilogue that wrote x stored beside it,
    else None. The residual stream is never changed in place (inference tensors keep no version to tell)."""
    return getattr(x, SQUARES, None) if norm is not None and norm.unit else None


def launch(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor, ring: Ring,
           fused: Fused | None = None, squares: torch.Tensor | None = None, eps: float = 0.0,
           squares_out: torch.Tensor | None = None, o: Order | None = None) -> torch.Tensor:  # fmt: skip
    """y [M, N] = x2 [M, K] @ weight^T (+ bias), then `fused`'s epilogue, the weight read through `ring`
    (`fits(x2, weight)` checked by the caller); with `squares` (partial sums of x2's rows' squares, [tiles, M]) the
    rows normed by a unit RMSNorm of `eps` first; `squares_out` ([cdiv(N, ring.block_n), M] fp32) gets y's. K is
    cut as `o` says (the sweep's cuts, taken as they are), else as `ring_order` makes of the invariant `order`."""
    fused = fused or Fused()
    M, K = x2.shape
    N = y.shape[1]
    block_m = max(16, triton.next_power_of_2(M))
    grid_n = triton.cdiv(N, ring.block_n)
    o = o or ring_order(order(N, K, x2.dtype), K, grid_n, ring.one_slice_k)
    stages = stages_that_fit(ring, block_m, o.block_k * x2.element_size(), fused.epilogue == SWIGLU)
    x_desc = TensorDescriptor.from_tensor(x2, block_shape=[block_m, o.block_k])
    w_desc = TensorDescriptor.from_tensor(weight, block_shape=[ring.block_n, o.block_k])
    arrived = arrival_counts(x2.device, grid_n)  # read only with split_k > 1, but typed for any launch's compile
    if o.split_k > 1:
        part = torch.empty(o.split_k, M, 2 * N if fused.epilogue == SWIGLU else N, dtype=torch.float32,
                           device=x2.device)  # fmt: skip
    else:
        part = y  # never read
    res, out = fused.residual, squares_out
    _matmul_tma[(grid_n, o.split_k)](
        x_desc, w_desc, weight, y if bias is None else bias, y, part, arrived, y if res is None else res,
        y if squares is None else squares, y if out is None else out, M, N, K, o.k_per_split, o.split_k,
        0 if squares is None else squares.shape[0], eps, weight.stride(0), y.stride(0),
        part.stride(0) if o.split_k > 1 else 0, part.stride(1) if o.split_k > 1 else 0,
        0 if res is None else res.stride(0), HAS_BIAS=bias is not None, EPILOGUE=fused.epilogue,
        PRECISION=precision(x2.dtype, x2.device), BLOCK_M=block_m, BLOCK_N=ring.block_n, BLOCK_K=o.block_k,
        STAGES=stages, PREFETCH=ring.prefetch if pdl.sm90(x2.device) else 0,
        TILES_IN=0 if squares is None else triton.next_power_of_2(squares.shape[0]), SQUARES_OUT=out is not None,
        num_warps=4, **pdl.launch(x2.device),
    )  # fmt: skip
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, ring: Ring,
           residual: torch.Tensor | None = None, swiglu: bool = False, norm=None,
           conv=None) -> torch.Tensor:  # fmt: skip
    """invariant.matmul.linear's call (its conv after as a kernel of its own) through `ring`; calls TMA cannot read
    (and empty ones) go there. A unit `norm` of an x this ring's residual epilogue wrote runs inside the launch, on
    the sums of squares that epilogue left on x (`carried_squares`); any other norm runs first, as its own kernel.
    A residual epilogue's output so carries its own sums."""
    N = checked_width("linear", x, weight, bias, residual, swiglu)
    K = weight.shape[1]
    x2 = as_rows(x, K)
    squares = carried_squares(x, norm) if fits(x2, weight) else None
    if norm is not None and squares is None:
        x = norm(x)
        x2 = as_rows(x, K)
    if not (x2.shape[0] and fits(x2, weight)):
        y = invariant_linear(x2, weight, bias, residual=None if residual is None else as_rows(residual, N),
                             swiglu=swiglu)  # fmt: skip
        return finished(y, x, conv)
    y = torch.empty(x2.shape[0], N, dtype=x.dtype, device=x.device)
    fused = Fused(None if residual is None else as_rows(residual, N), epilogue_of(residual, swiglu))
    out = None
    if residual is not None and conv is None:
        out = torch.empty(triton.cdiv(N, ring.block_n), x2.shape[0], dtype=torch.float32, device=x.device)
    launch(x2, weight, bias, y, ring, fused, squares, norm.eps if squares is not None else 0.0, out)
    y = finished(y, x, conv)
    if out is not None:
        setattr(y, SQUARES, out)
    return y


def finished(y: torch.Tensor, x: torch.Tensor, conv) -> torch.Tensor:
    """y [rows, N] in x's leading shape, then `conv` on it."""
    y = y.reshape(*x.shape[:-1], y.shape[1])
    return y if conv is None else conv(y)
