"""The routed experts on the GPU: (token, k) pairs grouped by expert, one Triton launch per projection.

`route_in_one_launch` (`_route`) gives moe.route's weights and expert ids from the router logits in one launch.
`align` sorts the pairs by expert and lays them out in blocks of BLOCK_M rows, each block one expert's (its last
block padded with empty rows), in buffers of a size fixed by (tokens, k, experts) alone: no host sync, so a decode
step with it is captured in a CUDA graph. Up to ALIGN_MAX_PAIRS pairs (decode) one Triton program does it
(`_align`: a histogram, a sort, two scans) where the torch ops take some twenty launches. Then
- `_gate_up`: per block, its rows' [gate | up] = x @ W_gate_up[e]^T with silu(gate) * up in the epilogue;
- `_down`: per block, (silu(gate) * up) @ W_down[e]^T scaled by each pair's routing weight;
- `_combine`: the k outputs of a token added in k order in float32, as moe.sum_over_k, then the gated shared expert
  and the residual, rounded as moe.combine rounds (no torch.compile graph in a decode step: dynamo would trace it
  again in every new process).
Each expert's weights are read once per column tile, however many of its tokens the step holds. A row's dot
products run over K in the same BLOCK_K steps wherever the row sits in its block, so a token's output does not
depend on the other tokens of the batch (and with `dot`'s in-order interpreter path, not on numpy's BLAS either).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import pdl
from .invariant.dot import dot, precision
from .invariant.elementwise import sigmoid
from .invariant.rounding import cast
from .moe import expert_order
from .pdl import wait_then_release


@dataclass(frozen=True)
class Launch:
    """How one projection's launch covers its columns: speed only (the K steps, hence a row's sums, stay fixed)."""

    block_n: int
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class Tiles:
    block_m: int  # rows per block: the layout `align` writes, shared by both projections
    block_k: int
    gate_up: Launch
    down: Launch


def tiles(pairs: int, dtype: torch.dtype, device: torch.device) -> Tiles:
    """Speed only, never a value's bits: decode's few pairs per expert take 16-row blocks and narrow columns (more
    programs stream the weights); prefill's many take 64-row blocks. The interpreter keeps tiny tiles."""
    if device.type == "cpu":
        return Tiles(16, 32, Launch(32), Launch(32))
    block_k = 32 if dtype == torch.float32 else 64
    if pairs <= 1024:
        return Tiles(16, block_k, Launch(32, 4, 5), Launch(32, 2, 5))  # moe_bench --sweep, both MoE shapes
    return Tiles(64, block_k, Launch(64), Launch(64))


def max_blocks(pairs: int, num_experts: int, block_m: int) -> int:
    """The most BLOCK_M-row blocks any routing of `pairs` pairs needs: one partial block per expert hit (at most
    min(E, pairs) of them) plus the full ones."""
    return min(num_experts, pairs) + triton.cdiv(pairs, block_m)


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair_of_row [blocks * block_m]: the pair index at each padded row, `pairs` where the row is empty;
    expert_of_block [blocks]: each block's expert, num_experts past the last used block). Static sizes only."""
    flat = ids.reshape(-1)
    pairs = flat.numel()
    order, counts = expert_order(ids, num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    first = counts.cumsum(0) - counts  # each expert's first place in `order`
    expert = flat[order]
    rank = torch.arange(pairs, device=ids.device) - first[expert]
    blocks = max_blocks(pairs, num_experts, block_m)
    pair_of_row = torch.full((blocks * block_m,), pairs, dtype=torch.int64, device=ids.device)
    pair_of_row[padded_end[expert] - padded[expert] + rank] = order
    starts = torch.arange(blocks, device=ids.device) * block_m
    expert_of_block = torch.searchsorted(padded_end, starts, right=True)
    return pair_of_row, expert_of_block


ALIGN_MAX_PAIRS = 1024  # up to here `align` is one Triton program; beyond, torch ops (prefill: their cost is noise)


@triton.jit
def _align(
    ids_ptr, pair_of_row, expert_of_block, firsts, PAIRS, ROWS, BLOCKS,
    NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, P: tl.constexpr, E: tl.constexpr, R: tl.constexpr,
    NB: tl.constexpr,
):  # fmt: skip
    """`align`'s two buffers from the flat expert ids, in one program: per expert its count (a histogram), its first
    place in expert order and its first row (exclusive scans, kept in `firsts` to be gathered); then the pairs
    sorted stably by expert (keys expert * P + pair), each stored at its expert's first row plus its rank, and
    each block's expert written by the pair at the block's first row."""
    i = tl.arange(0, P)
    expert = tl.load(ids_ptr + i, mask=i < PAIRS, other=NUM_EXPERTS).to(tl.int32)  # lanes past the pairs: no expert
    bins = tl.arange(0, E)
    counts = tl.histogram(expert, E)
    padded = tl.where(bins < NUM_EXPERTS, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    tl.store(firsts + bins, tl.cumsum(counts, 0) - counts)
    tl.store(firsts + E + bins, tl.cumsum(padded, 0) - padded)
    rows, blocks = tl.arange(0, R), tl.arange(0, NB)
    tl.store(pair_of_row + rows, PAIRS, mask=rows < ROWS)
    tl.store(expert_of_block + blocks, NUM_EXPERTS, mask=blocks < BLOCKS)
    tl.debug_barrier()  # the scans and the empty rows are in memory before any thread reads or overwrites them
    key = tl.sort(expert * P + i)  # position i of the stable expert order
    e, pair = key // P, key % P
    live = e < NUM_EXPERTS
    rank = i - tl.load(firsts + e, mask=live, other=0)
    row = tl.load(firsts + E + e, mask=live, other=0) + rank
    tl.store(pair_of_row + row, pair, mask=live)
    tl.store(expert_of_block + row // BLOCK_M, e, mask=live & (rank % BLOCK_M == 0))


def align_in_one_launch(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`align`'s result (the same buffers, bit for bit) from one Triton program; up to ALIGN_MAX_PAIRS pairs."""
    flat = ids.reshape(-1).contiguous()
    pairs = flat.numel()
    if pairs > ALIGN_MAX_PAIRS:
        raise ValueError(f"align_in_one_launch takes up to {ALIGN_MAX_PAIRS} pairs, got {pairs}")
    blocks = max_blocks(pairs, num_experts, block_m)
    pair_of_row = torch.empty(blocks * block_m, dtype=torch.int64, device=ids.device)
    expert_of_block = torch.empty(blocks, dtype=torch.int64, device=ids.device)
    E = triton.next_power_of_2(num_experts + 1)  # one bin more: the lanes past the pairs
    firsts = torch.empty(2 * E, dtype=torch.int32, device=ids.device)
    _align[(1,)](
        flat, pair_of_row, expert_of_block, firsts, pairs, blocks * block_m, blocks,
        NUM_EXPERTS=num_experts, BLOCK_M=block_m, P=triton.next_power_of_2(max(pairs, 2)), E=E,
        R=triton.next_power_of_2(blocks * block_m), NB=triton.next_power_of_2(blocks),
    )  # fmt: skip
    return pair_of_row, expert_of_block


@triton.jit
def _gate_up(
    x_ptr,
    w_ptr,
    out_ptr,
    pair_of_row,
    expert_of_block,
    PAIRS,
    H,
    I,
    stride_x,
    stride_we,
    stride_wn,
    stride_o,
    TOP_K: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """out[pair, n] = silu(x[token] . W[e, n]) * (x[token] . W[e, I + n]) for the block's rows."""
    block = tl.program_id(0)
    e = tl.load(expert_of_block + block)
    if e >= NUM_EXPERTS:
        return
    pair = tl.load(pair_of_row + block * BLOCK_M + tl.arange(0, BLOCK_M))
    live = pair < PAIRS
    token = tl.where(live, pair // TOP_K, 0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < I
    w = w_ptr + e.to(tl.int64) * stride_we
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < H
        a = tl.load(x_ptr + token[:, None] * stride_x + k[None, :], mask=live[:, None] & k_ok[None, :], other=0.0)
        both = k_ok[:, None] & n_ok[None, :]
        wg = tl.load(w + n[None, :] * stride_wn + k[:, None], mask=both, other=0.0)
        wu = tl.load(w + (n[None, :] + I) * stride_wn + k[:, None], mask=both, other=0.0)
        gate = dot(a, wg, gate, PRECISION)
        up = dot(a, wu, up, PRECISION)
    y = gate * tl.sigmoid(gate) * up
    mask = live[:, None] & n_ok[None, :]
    tl.store(out_ptr + pair[:, None] * stride_o + n[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _down(
    h_ptr,
    w_ptr,
    weights_ptr,
    out_ptr,
    pair_of_row,
    expert_of_block,
    PAIRS,
    H,
    I,
    stride_h,
    stride_we,
    stride_wn,
    stride_o,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """out[pair, n] = weight[pair] * (h[pair] . W[e, n]) for the block's rows."""
    block = tl.program_id(0)
    e = tl.load(expert_of_block + block)
    if e >= NUM_EXPERTS:
        return
    pair = tl.load(pair_of_row + block * BLOCK_M + tl.arange(0, BLOCK_M))
    live = pair < PAIRS
    row = tl.where(live, pair, 0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < H
    w = w_ptr + e.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < I
        a = tl.load(h_ptr + row[:, None] * stride_h + k[None, :], mask=live[:, None] & k_ok[None, :], other=0.0)
        wd = tl.load(w + n[None, :] * stride_wn + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = dot(a, wd, acc, PRECISION)
    acc = acc * tl.load(weights_ptr + row, mask=live, other=0.0).to(tl.float32)[:, None]
    mask = live[:, None] & n_ok[None, :]
    tl.store(out_ptr + pair[:, None] * stride_o + n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _combine(pairs_ptr, out_ptr, shared_ptr, gate_ptr, residual_ptr, H, stride_s, stride_g, stride_r,
             TOP_K: tl.constexpr, SHARED: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """out[token] = [residual +] (pairs[token, 0] + ... + pairs[token, k-1] [+ shared * sigmoid(gate)]): the k outputs
    added in k order in float32, then each step rounded to the dtype where moe.combine's torch ops round."""
    token = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = n < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(pairs_ptr + (token * TOP_K + j) * H + n, mask=live, other=0.0).to(tl.float32)
    shared = tl.load(shared_ptr + token * stride_s + n, mask=live, other=0.0).to(tl.float32) if SHARED else acc
    y = finish_token(acc, token, n, live, shared, gate_ptr, residual_ptr, stride_g, stride_r,
                     out_ptr.dtype.element_ty, SHARED, RESIDUAL)  # fmt: skip
    tl.store(out_ptr + token * H + n, y, mask=live)


@triton.jit
def finish_token(acc, token, n, live, s, gate_ptr, residual_ptr, stride_g, stride_r, dtype: tl.constexpr,
                 SHARED: tl.constexpr, RESIDUAL: tl.constexpr):  # fmt: skip
    """A token's float32 sum of its k routed outputs (columns n) -> [residual +] (sum [+ s * sigmoid(gate)]) in
    `dtype`, each step rounded where moe.combine's torch ops round; s: the shared expert's output (float32 holding
    dtype values), read with SHARED only."""
    y = cast(acc, dtype).to(tl.float32)
    if SHARED:
        g = cast(sigmoid(tl.load(gate_ptr + token * stride_g).to(tl.float32)), dtype).to(tl.float32)
        y = cast(y + cast(s * g, dtype).to(tl.float32), dtype).to(tl.float32)
    if RESIDUAL:
        y = tl.load(residual_ptr + token * stride_r + n, mask=live, other=0.0).to(tl.float32) + y
    return cast(y, dtype)


def fused_experts(
    x, gate_up, down, weights, ids, residual=None, shared=None, shared_gate=None, t: Tiles | None = None
) -> torch.Tensor:
    """Same contract as moe.looped_experts (x [N, H], gate_up [E, 2I, H], down [E, H, I], weights/ids [N, k]; the
    residual and the gated shared expert added in the k-sum's launch). t: the launches' tiles (default
    `tiles(...)`; the bench's sweep passes others)."""
    N, top_k = ids.shape
    E, two_i, H = gate_up.shape
    I = two_i // 2  # noqa: E741
    if gate_up.stride(2) != 1 or down.stride(2) != 1:
        raise ValueError("fused_experts needs expert weights contiguous along their input dimension")
    x = x.contiguous()
    pairs = N * top_k
    t = t or tiles(pairs, x.dtype, x.device)
    aligned = align_in_one_launch if pairs <= ALIGN_MAX_PAIRS else align
    pair_of_row, expert_of_block = aligned(ids, E, t.block_m)
    blocks = expert_of_block.numel()
    prec = precision(x.dtype, x.device)

    def launch(p: Launch) -> dict:
        cuda = dict(num_warps=p.num_warps, num_stages=p.num_stages) if x.is_cuda else {}
        return dict(BLOCK_M=t.block_m, BLOCK_N=p.block_n, BLOCK_K=t.block_k, PRECISION=prec, **cuda)

    h = torch.empty(pairs, I, dtype=x.dtype, device=x.device)
    _gate_up[(blocks, triton.cdiv(I, t.gate_up.block_n))](
        x, gate_up, h, pair_of_row, expert_of_block, pairs, H, I,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), h.stride(0),
        TOP_K=top_k, NUM_EXPERTS=E, **launch(t.gate_up),
    )  # fmt: skip
    out = torch.empty(pairs, H, dtype=x.dtype, device=x.device)
    _down[(blocks, triton.cdiv(H, t.down.block_n))](
        h, down, weights.reshape(-1).contiguous(), out, pair_of_row, expert_of_block, pairs, H, I,
        h.stride(0), down.stride(0), down.stride(1), out.stride(0),
        NUM_EXPERTS=E, **launch(t.down),
    )  # fmt: skip
    total = torch.empty(N, H, dtype=x.dtype, device=x.device)
    if N:
        s, g, r = (out if a is None else a for a in (shared, shared_gate, residual))  # absent: a pointer never read
        _combine[(N, triton.cdiv(H, 1024))](
            out, total, s, g, r, H, s.stride(0), g.stride(0), r.stride(0),
            TOP_K=top_k, SHARED=shared is not None, RESIDUAL=residual is not None, BLOCK=1024,
        )  # fmt: skip
    return total


@triton.jit
def _route(logits_ptr, stride, weights_ptr, ids_ptr, NUM_EXPERTS, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
           BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """One token's routing: softmax over its experts in float32, the k largest (equal ones: the lowest expert
    first), optionally rescaled to sum 1, in the logits' dtype. Launched with PDL as the router before it and the
    experts after it are: without it, it waits for the router's whole end and lets no later kernel start early.
    One warp: its 2k + 2 reductions stay warp shuffles (2% of a 30B-A3B step, reports/gpu/ab-early-loads-*)."""
    wait_then_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + row * stride + e, mask=e < NUM_EXPERTS, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = p / tl.sum(p, 0)
    left = tl.where(e < NUM_EXPERTS, p, -1.0)  # probabilities are >= 0: a lane past the experts is never taken
    j = tl.arange(0, BLOCK_K)
    top = tl.zeros((BLOCK_K,), dtype=tl.float32)
    which = tl.zeros((BLOCK_K,), dtype=tl.int64)
    for i in tl.static_range(TOP_K):
        best = tl.max(left, 0)
        pick = tl.min(tl.where(left == best, e, BLOCK_E), 0)
        top = tl.where(j == i, best, top)
        which = tl.where(j == i, pick, which)
        left = tl.where(e == pick, -1.0, left)
    if RENORMALIZE:
        top = top / tl.sum(top, 0)
    tl.store(weights_ptr + row * TOP_K + j, top.to(weights_ptr.dtype.element_ty), mask=j < TOP_K)
    tl.store(ids_ptr + row * TOP_K + j, which, mask=j < TOP_K)


def route_in_one_launch(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """moe.route's (weights [N, k], ids [N, k]) in one launch where torch takes five (softmax, topk, sum, divide,
    cast). logits [N, E] may be a column slice (the shared expert's gate beside them)."""
    N, E = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("route_in_one_launch needs each token's logits contiguous")
    if not 0 < top_k <= E:
        raise ValueError(f"top_k must be in 1..{E} (the experts), got {top_k}")
    weights = torch.empty(N, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(N, top_k, dtype=torch.int64, device=logits.device)
    if N:
        _route[(N,)](
            logits, logits.stride(0), weights, ids, E, TOP_K=top_k, RENORMALIZE=renormalize,
            BLOCK_E=triton.next_power_of_2(E), BLOCK_K=triton.next_power_of_2(top_k),
            num_warps=1, **pdl.launch(logits.device),
        )  # fmt: skip
    return weights, ids
