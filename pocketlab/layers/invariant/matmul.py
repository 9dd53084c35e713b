"""y = x @ W^T (+ b) with every output element reduced in an order fixed by (N, K, dtype), never by M.

cuBLAS picks its kernel, tile and split-K by the whole shape, so a row's result changes with the number of
rows beside it. Here one tile configuration comes from `config(N, K, dtype)` alone; rows never mix inside
tl.dot, so other rows (or padding rows) cannot change a row. Where the weight alone gives too few tiles to
fill the GPU, K is split into a count of slices fixed by (N, K), and a second kernel adds the slices' fp32
partials in slice order (no atomics), so the sum is the same for every M.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .rounding import cast

PROGRAMS_WANTED = 256  # about two programs per SM of an H200 (132 SMs) for the weight-bound decode shapes
MIN_BLOCKS_PER_SPLIT = 4  # each K slice keeps at least this many BLOCK_K steps, so its load pipeline fills
MAX_SPLIT = 8
ROW_CHUNK = 1024  # rows per launch when K is split: bounds the fp32 partial buffer (split x ROW_CHUNK x N)


@dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    block_k: int
    split_k: int  # number of K slices, summed in order by a second kernel when > 1
    k_per_split: int  # a multiple of block_k
    num_warps: int
    num_stages: int


def config(N: int, K: int, dtype: torch.dtype) -> Tiles:
    """The one tile configuration for an [N, K] weight: the reduction order of y[m, n] follows from it alone.

    16-bit: 64 x 64 tiles (one Hopper warpgroup MMA) stepping 128 along K; 128-wide N tiles only where N alone
    gives two programs per SM (lm_head), as larger tiles help prefill. float32 runs IEEE FMA dots (no tensor
    cores) in 64 x 128 tiles stepping 32 along K over 8 warps: 32 accumulators per thread, no register spills,
    48 KB of staged operands. The split count tops the weight's N tiles up to about PROGRAMS_WANTED programs at
    M <= block_m; it holds for prefill too, where writing and reading the fp32 partials (8 bytes per output and
    slice) costs about what the arithmetic of a 1024-long slice does, the price of one order for every M.
    """
    if N <= 0 or K <= 0:
        raise ValueError(f"linear needs N, K >= 1, got N={N}, K={K}")
    if dtype in (torch.bfloat16, torch.float16):
        block_m, block_k, num_warps = 64, 128, 4
        block_n = 128 if triton.cdiv(N, 128) >= PROGRAMS_WANTED else 64
        num_stages = 3 if block_n == 128 else 4
    elif dtype == torch.float32:
        block_m, block_n, block_k, num_warps, num_stages = 64, 128, 32, 8, 3
    else:
        raise ValueError(f"linear supports float32, bfloat16, float16; got {dtype}")
    n_tiles = triton.cdiv(N, block_n)
    k_blocks = triton.cdiv(K, block_k)
    split = max(1, min(PROGRAMS_WANTED // n_tiles, k_blocks // MIN_BLOCKS_PER_SPLIT, MAX_SPLIT))
    k_per_split = triton.cdiv(k_blocks, split) * block_k
    split = triton.cdiv(K, k_per_split)  # no empty slice
    return Tiles(block_m, block_n, block_k, split, k_per_split, num_warps, num_stages)


@triton.jit(do_not_specialize=["row0", "rows"])
def _matmul(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    row0,
    rows,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_wk,
    stride_om,
    stride_os,
    K_PER_SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of rows row0 + ... over the K slice program_id(2), accumulated in fp32.
    PARTIAL: store the slice's fp32 sum at out[slice, local row, n]; else add the bias, round, store y."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # rows local to this launch
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live_m, live_n = m < rows, n < N
    x_rows = x_ptr + (row0 + m).to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + n.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * K_PER_SPLIT
    for k0 in range(k_start, tl.minimum(k_start + K_PER_SPLIT, K), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        live_k = k < K
        a = tl.load(x_rows + k[None, :], mask=live_m[:, None] & live_k[None, :], other=0.0)
        b = tl.load(w_cols + k[:, None] * stride_wk, mask=live_k[:, None] & live_n[None, :], other=0.0)
        if UPCAST:  # Triton's CPU interpreter multiplies bf16 bit patterns as integers: give it floats
            a, b = a.to(tl.float32), b.to(tl.float32)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if PARTIAL:
        out = out_ptr + pid_k * stride_os + m[:, None] * stride_om + n[None, :]
        tl.store(out, acc, mask=live_m[:, None] & live_n[None, :])
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=live_n, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + (row0 + m).to(tl.int64)[:, None] * stride_om + n[None, :]
        tl.store(out, cast(acc, out_ptr.dtype.element_ty), mask=live_m[:, None] & live_n[None, :])


@triton.jit(do_not_specialize=["row0"])
def _sum_splits(
    part_ptr,
    b_ptr,
    y_ptr,
    row0,
    N,
    stride_ps,
    stride_pm,
    stride_ym,
    SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """y[row0 + m, n] = ((part[0] + part[1]) + ...) + bias, in slice order, rounded once to y's dtype."""
    m, nb = tl.program_id(0), tl.program_id(1)
    n = nb * BLOCK + tl.arange(0, BLOCK)
    live = n < N
    acc = tl.load(part_ptr + m * stride_pm + n, mask=live, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(part_ptr + s * stride_ps + m * stride_pm + n, mask=live, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=live, other=0.0).to(tl.float32)
    y = y_ptr + (row0 + m).to(tl.int64) * stride_ym + n
    tl.store(y, cast(acc, y_ptr.dtype.element_ty), mask=live)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) whose rows do not depend on one another: x [..., K], weight [N, K], bias [N];
    fp32 accumulation, the bias added in fp32 before the one rounding to x's dtype."""
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match as [..., K], [N, K]"
        )
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(
            f"linear: x, weight and bias must share a dtype, got {x.dtype}, {weight.dtype}, "
            f"{None if bias is None else bias.dtype}"
        )
    N, K = weight.shape
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"linear: bias {tuple(bias.shape)} should be [{N}]")
    tiles = config(N, K, x.dtype)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y.reshape(*lead, N)
    has_bias = bias is not None
    bias_arg = bias.contiguous() if has_bias else y  # never read without HAS_BIAS
    upcast = x.dtype == torch.bfloat16 and x.device.type == "cpu"  # Triton's interpreter: see _matmul
    kernel_args = dict(
        K_PER_SPLIT=tiles.k_per_split,
        HAS_BIAS=has_bias,
        IEEE=x.dtype == torch.float32 or upcast,
        UPCAST=upcast,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )

    def run(out, row0, rows, stride_out_row, stride_out_split):
        grid = (triton.cdiv(rows, tiles.block_m), triton.cdiv(N, tiles.block_n), tiles.split_k)
        _matmul[grid](x2, weight, bias_arg, out, row0, rows, N, K, x2.stride(0), weight.stride(0), weight.stride(1),
                      stride_out_row, stride_out_split, PARTIAL=tiles.split_k > 1, **kernel_args)  # fmt: skip

    if tiles.split_k == 1:
        run(y, 0, M, y.stride(0), 0)
        return y.reshape(*lead, N)
    chunk = min(M, ROW_CHUNK)
    partial = torch.empty(tiles.split_k, chunk, N, dtype=torch.float32, device=x.device)
    sum_block = min(1024, triton.next_power_of_2(N))
    for row0 in range(0, M, chunk):
        rows = min(chunk, M - row0)
        run(partial, row0, rows, partial.stride(1), partial.stride(0))
        _sum_splits[(rows, triton.cdiv(N, sum_block))](
            partial, bias_arg, y, row0, N, partial.stride(0), partial.stride(1), y.stride(0),
            SPLIT=tiles.split_k, HAS_BIAS=has_bias, BLOCK=sum_block, num_warps=4,
        )  # fmt: skip
    return y.reshape(*lead, N)
