"""y = x @ W^T (+ b) with every output element reduced in an order fixed by (N, K, dtype), never by M.

cuBLAS picks its kernel, tile and split-K by the whole shape, so a row's result changes with the number of
rows beside it. Here the order of every element's sum is an `Order` from (N, K, dtype) alone: K cut into
`split_k` slices, each slice one chain of block_k-wide dots into a fresh fp32 accumulator, the slices' sums
added in slice order. How a launch covers the rows (`Tiles`) is chosen by M, for speed, and cannot change an
element: rows never mix inside tl.dot, and each of the three ways to add the slices adds them in the same order:
- IN_PROGRAM: one program runs every slice of its tile (many rows: the GPU is full without splitting K);
- LAST_SUMS: one program per slice; each stores its fp32 partial, and the last of a tile's programs to finish
  (an atomic arrival count, no atomic arithmetic on data) adds them all in slice order (few rows: the slices
  fill the GPU, and no second kernel is launched);
- the CPU (Triton's interpreter) uses one tile shape for every M, since numpy's matmul is itself
  shape-dependent; on the GPU each element is one chain of MMA steps whatever the tile's M and N extent
  (tests/test_invariant_kernels.py checks the GPU's tiles bitwise against each other).
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import pdl
from ..arrivals import arrival_counts
from ..pdl import wait_then_release
from .dot import dot, precision
from .elementwise import sigmoid
from .rounding import cast

PROGRAMS_WANTED = 256  # about two programs per SM of an H200 (132 SMs) for the weight-bound decode shapes
MIN_BLOCKS_PER_SPLIT = 4  # each K slice keeps at least this many BLOCK_K steps, so its load pipeline fills
MAX_SPLIT = 8
DECODE_BLOCK_N = 64  # the N extent the split count is sized for (few-row tiles are 32 or 64 wide)
MANY_ROWS = 128  # from this many rows on, a program runs all slices of its tile (IN_PROGRAM)
IN_PROGRAM, LAST_SUMS = 0, 1


@dataclass(frozen=True)
class Order:
    """What fixes y[m, n]: K in `split_k` slices of `k_per_split` (a multiple of block_k), summed in order."""

    block_k: int
    split_k: int
    k_per_split: int


@dataclass(frozen=True)
class Tiles:
    """How one launch covers [M, N]: speed only, never an element's value."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    mode: int  # IN_PROGRAM or LAST_SUMS


def order(N: int, K: int, dtype: torch.dtype) -> Order:
    """16-bit inputs step 128 along K (float32 32: IEEE FMA dots, no tensor cores). The split count tops the
    weight's decode tiles (DECODE_BLOCK_N wide) up to about PROGRAMS_WANTED programs, each slice at least
    MIN_BLOCKS_PER_SPLIT steps long; many-row launches pay only an fp32 add per slice for it."""
    if N <= 0 or K <= 0:
        raise ValueError(f"linear needs N, K >= 1, got N={N}, K={K}")
    if dtype in (torch.bfloat16, torch.float16):
        block_k = 128
    elif dtype == torch.float32:
        block_k = 32
    else:
        raise ValueError(f"linear supports float32, bfloat16, float16; got {dtype}")
    k_blocks = triton.cdiv(K, block_k)
    split = max(1, min(PROGRAMS_WANTED // triton.cdiv(N, DECODE_BLOCK_N), k_blocks // MIN_BLOCKS_PER_SPLIT, MAX_SPLIT))
    k_per_split = triton.cdiv(k_blocks, split) * block_k
    return Order(block_k, triton.cdiv(K, k_per_split), k_per_split)  # no empty slice


def tiles(M: int, N: int, dtype: torch.dtype, device: torch.device, two_weights: bool = False) -> Tiles:
    """The launch for M rows: from MANY_ROWS rows on, one program runs all slices of its tile; fewer rows run
    a program per slice. GPU tiles for few rows: 16 x 32 up to 16 rows, then 32-64 rows (the fewest covering M,
    so each weight tile is read once) x 64; 128 x 128 for many (float32: 64 x 128 over 8 warps, 32 accumulators
    a thread, no spills); the interpreter keeps one tile shape."""
    mode = IN_PROGRAM if M >= MANY_ROWS else LAST_SUMS
    if dtype == torch.float32:
        return Tiles(64, 128, 8, 3, mode)
    if device.type != "cuda":
        return Tiles(64, DECODE_BLOCK_N, 4, 3, mode)
    if mode == IN_PROGRAM:  # SwiGLU streams two weight tiles: three stages of them overflow an H200's shared memory
        return Tiles(128, 128, 8, 2 if two_weights else 3, mode)
    if M <= 16:  # 32 columns: twice the programs of 64 for the same weight, the faster at decode shapes
        return Tiles(16, 32, 4, 4, mode)
    # 32x32 and three-stage tiles hold less shared memory but were no faster at 8B/9B b32 (thirty-first session)
    return Tiles(min(64, triton.next_power_of_2(M)), DECODE_BLOCK_N, 4, 4, mode)


@triton.jit
def _slice_sum(x_rows, w_cols, up_cols, live_m, live_n, k_start, k_end, K, stride_wk, TWO: tl.constexpr,
               PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):  # fmt: skip
    """sum over k in [k_start, k_end) of x[m, k] w[n, k] (and, TWO: of x[m, k] up[n, k]): one chain of BLOCK_K-wide
    dots from zero each, in fp32."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        live_k = k < K
        a = tl.load(x_rows + k[None, :], mask=live_m[:, None] & live_k[None, :], other=0.0)
        b = tl.load(w_cols + k[:, None] * stride_wk, mask=live_k[:, None] & live_n[None, :], other=0.0)
        acc = dot(a, b, acc, PRECISION)
        if TWO:
            b_up = tl.load(up_cols + k[:, None] * stride_wk, mask=live_k[:, None] & live_n[None, :], other=0.0)
            acc_up = dot(a, b_up, acc_up, PRECISION)
    return acc, acc_up


@triton.jit(do_not_specialize=["rows"])
def _matmul(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, arrived_ptr, res_ptr, rows, N, K, k_per_split, split_k,
            stride_xm, stride_wn, stride_wk, stride_ym, stride_ps, stride_pm, stride_rm, eps,
            MODE: tl.constexpr, HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr, ROW_NORM: tl.constexpr,
            K_ROW: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """One [BLOCK_M, BLOCK_N] tile of y: all K slices (IN_PROGRAM) or slice program_id(2) (LAST_SUMS).
    EPILOGUE 1: y = residual + x @ W^T; EPILOGUE 2: W is [gate | up] (2N rows) and y = silu(x @ gate^T) * (x @ up^T).
    ROW_NORM (one row, IN_PROGRAM): x is normed by a unit RMSNorm, its weight folded into W: the sums are scaled by
    rsqrt(mean(x^2) + eps) before the epilogue, x's whole row (K_ROW >= K lanes) read once beside the K loop."""
    wait_then_release(PDL)
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live_m, live_n = m < rows, n < N
    live = live_m[:, None] & live_n[None, :]
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + n.to(tl.int64)[None, :] * stride_wn
    up_cols = w_cols + N * stride_wn
    TWO: tl.constexpr = EPILOGUE == 2
    done = True
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    total_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if MODE == 0:  # IN_PROGRAM: ((slice 0 + slice 1) + slice 2) + ..., as LAST_SUMS adds the partials
        if ROW_NORM:  # in flight through the loop, not in its steps: work there slows the weight's stream
            k_row = tl.arange(0, K_ROW)
            x_row = tl.load(x_ptr + k_row, mask=k_row < K, other=0.0)
        for s in range(0, split_k):
            k_start = s * k_per_split
            acc, acc_up = _slice_sum(x_rows, w_cols, up_cols, live_m, live_n, k_start,
                                     tl.minimum(k_start + k_per_split, K), K, stride_wk, TWO, PRECISION,
                                     BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
            total += acc
            total_up += acc_up
        if ROW_NORM:
            x_row = x_row.to(tl.float32)
            inv_rms = tl.math.rsqrt(tl.sum(x_row * x_row, axis=0) / K + eps)
            total *= inv_rms
            total_up *= inv_rms
    else:  # LAST_SUMS
        s = tl.program_id(2)
        k_start = s * k_per_split
        acc, acc_up = _slice_sum(x_rows, w_cols, up_cols, live_m, live_n, k_start,
                                 tl.minimum(k_start + k_per_split, K), K, stride_wk, TWO, PRECISION,
                                 BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
        arrivals = arrived_ptr + pid_m * tl.num_programs(1) + pid_n  # this tile's count
        total, total_up, done = last_sums(acc, acc_up, part_ptr + m[:, None] * stride_pm + n[None, :], arrivals, s,
                                          split_k, live, stride_ps, N, TWO)  # fmt: skip
    if done:
        dtype = y_ptr.dtype.element_ty
        y = finish(total, total_up, b_ptr, res_ptr, m, n, live_m, live_n, stride_rm, dtype, HAS_BIAS, EPILOGUE)
        tl.store(y_ptr + m.to(tl.int64)[:, None] * stride_ym + n[None, :], y, mask=live)


@triton.jit
def last_sums(acc, acc_up, parts, arrivals, s, split_k, live, stride_ps, N, TWO: tl.constexpr):
    """Slice s's fp32 partials (acc, and acc_up when TWO) stored at `parts` (slice s at s * stride_ps, the up half N
    further) and counted in at `arrivals`: the last of the split_k slices to arrive gets (their sum in slice order,
    the same for up, True) and zeroes the count for the next launch; the others get (zeros, zeros, False)."""
    tl.store(parts + s * stride_ps, acc, mask=live)
    if TWO:
        tl.store(parts + s * stride_ps + N, acc_up, mask=live)
    # release our partials, acquire the others': the last arrival sees every slice's stores. The atomic runs on one
    # thread: the barrier first puts every thread's stores before it
    tl.debug_barrier()
    done = tl.atomic_add(arrivals, 1, sem="acq_rel") == split_k - 1
    total = tl.zeros(acc.shape, dtype=tl.float32)
    total_up = tl.zeros(acc.shape, dtype=tl.float32)
    if done:
        for t in range(0, split_k):
            total += tl.load(parts + t * stride_ps, mask=live, other=0.0, volatile=True)
            if TWO:
                total_up += tl.load(parts + t * stride_ps + N, mask=live, other=0.0, volatile=True)
        tl.atomic_xchg(arrivals, 0)  # ready for the next launch
    return total, total_up, done


@triton.jit
def finish(total, total_up, b_ptr, res_ptr, m, n, live_m, live_n, stride_rm, dtype: tl.constexpr,
           HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr):  # fmt: skip
    """The fp32 sums of rows m x columns n -> y in `dtype`: the bias added before the one rounding, then the
    EPILOGUE (1: residual + y in the dtype; 2: SwiGLU of the gate and up sums, rounded as activations.swiglu)."""
    if HAS_BIAS:
        total += tl.load(b_ptr + n, mask=live_n, other=0.0).to(tl.float32)[None, :]
    y = cast(total, dtype)
    if EPILOGUE == 1:
        live = live_m[:, None] & live_n[None, :]
        r = tl.load(res_ptr + m.to(tl.int64)[:, None] * stride_rm + n[None, :], mask=live, other=0.0)
        y = cast(y.to(tl.float32) + r.to(tl.float32), dtype)
    elif EPILOGUE == 2:
        gate = y.to(tl.float32)
        silu = cast(gate * sigmoid(gate), dtype).to(tl.float32)
        y = cast(silu * cast(total_up, dtype).to(tl.float32), dtype)
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           residual: torch.Tensor | None = None, swiglu: bool = False, norm=None,
           conv=None) -> torch.Tensor:  # fmt: skip
    """F.linear(x, weight, bias) whose rows do not depend on one another: x [..., K], weight [N, K], bias [N];
    fp32 accumulation, the bias added in fp32 before the one rounding to x's dtype. Fused into the same kernel:
    `residual` [..., N] added after (residual + y); `swiglu`: weight is [gate | up] ([2N, K]) and
    y = silu(x @ gate^T) * (x @ up^T) [..., N]. `norm` (a layers.norm.RMSNorm) runs first, as its own kernel, save
    a unit one (its weight folded into `weight`) at one row where one program runs all of K: there the launch scales
    the row's sums by the norm's rsqrt (the squares summed in the launch's own order, so only engines that are not
    batch invariant fold a norm). `conv` (a linear_decode.ConvStep) runs after, as its own."""
    N = checked_width("linear", x, weight, bias, residual, swiglu)
    K = weight.shape[1]
    M = x.numel() // K
    o, t = order(N, K, x.dtype), tiles(M, N, x.dtype, x.device, swiglu)
    in_launch = norm is not None and norm.unit and M == 1 and not splits_k(o, t)
    if norm is not None and not in_launch:
        x = norm(x)
    x2 = as_rows(x, K)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M:
        residual = None if residual is None else as_rows(residual, N)
        fused = Fused(residual, epilogue_of(residual, swiglu), norm.eps if in_launch else None)
        launch(x2, weight, bias, y, o, t, fused)
    y = y.reshape(*x.shape[:-1], N)
    return y if conv is None else conv(y)


def checked_width(name: str, x, weight, bias, residual, swiglu: bool) -> int:
    """The output width N of a fused linear's arguments (`name`'s, for the message), or a ValueError saying which
    of x [..., K], weight [N, K] ([2N, K] for swiglu), bias [N], residual [..., N] does not fit."""
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        shapes = f"x {tuple(x.shape)} and weight {tuple(weight.shape)}"
        raise ValueError(f"{name}: {shapes} do not match as [..., K], [N, K]")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(
            f"{name}: x, weight and bias must share a dtype, got {x.dtype}, {weight.dtype}, "
            f"{None if bias is None else bias.dtype}"
        )
    N = weight.shape[0]
    if swiglu and (N % 2 or bias is not None or residual is not None):
        raise ValueError(f"{name}: swiglu needs a [gate | up] weight of even rows ({N}), no bias, no residual")
    N = N // 2 if swiglu else N
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"{name}: bias {tuple(bias.shape)} should be [{N}]")
    lead = x.shape[:-1]
    if residual is not None and (residual.shape != (*lead, N) or residual.dtype != x.dtype):
        raise ValueError(f"{name}: residual {tuple(residual.shape)} {residual.dtype} should be {(*lead, N)} {x.dtype}")
    return N


def as_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """t as [rows, n] with unit stride along n (a copy only where it has none)."""
    t = t.reshape(-1, n)
    return t if t.stride(-1) == 1 else t.contiguous()


def epilogue_of(residual: torch.Tensor | None, swiglu: bool) -> int:
    return RESIDUAL if residual is not None else SWIGLU if swiglu else PLAIN


PLAIN, RESIDUAL, SWIGLU = 0, 1, 2  # the epilogues


@dataclass(frozen=True)
class Fused:
    """What runs in the matmul's kernel besides the dot: a unit RMSNorm of x (`norm_eps`, None: none), then PLAIN,
    RESIDUAL (residual [M, N] + y) or SWIGLU."""

    residual: torch.Tensor | None = None
    epilogue: int = PLAIN
    norm_eps: float | None = None


def splits_k(o: Order, t: Tiles) -> bool:
    """Whether the launch runs a program per K slice (the last of a tile's programs adding their partials)."""
    return t.mode == LAST_SUMS and o.split_k > 1


def launch(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor, o: Order,
           t: Tiles, fused: Fused = Fused()) -> torch.Tensor:  # fmt: skip
    """y[M, N] = x2 @ weight^T (+ bias) in order `o` with the launch `t` (the sweep tries others)."""
    M, K = x2.shape
    N = y.shape[1]
    grid_m, grid_n = triton.cdiv(M, t.block_m), triton.cdiv(N, t.block_n)
    split = splits_k(o, t)
    if fused.norm_eps is not None and (split or M != 1):
        raise ValueError("a unit norm in the matmul's launch needs one row and one program over all of K")
    if split:
        width = 2 * N if fused.epilogue == SWIGLU else N
        part = torch.empty(o.split_k, M, width, dtype=torch.float32, device=x2.device)
        arrived = arrival_counts(x2.device, grid_m * grid_n)
    else:
        part = arrived = y  # never read
    res = fused.residual
    _matmul[(grid_m, grid_n, o.split_k if split else 1)](
        x2, weight, y if bias is None else bias, y, part, arrived, y if res is None else res, M, N, K, o.k_per_split,
        o.split_k, x2.stride(0), weight.stride(0), weight.stride(1), y.stride(0), part.stride(0) if split else 0,
        part.stride(1) if split else 0, 0 if res is None else res.stride(0), fused.norm_eps or 0.0,
        MODE=LAST_SUMS if split else IN_PROGRAM, HAS_BIAS=bias is not None, EPILOGUE=fused.epilogue,
        ROW_NORM=fused.norm_eps is not None, K_ROW=triton.next_power_of_2(K) if fused.norm_eps is not None else 1,
        PRECISION=precision(x2.dtype, x2.device), BLOCK_M=t.block_m, BLOCK_N=t.block_n,
        BLOCK_K=o.block_k, num_warps=t.num_warps, num_stages=t.num_stages, **pdl.launch(x2.device),
    )  # fmt: skip
    return y
