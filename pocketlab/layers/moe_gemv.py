"""The routed experts of a decode step's one token (or few): each program streams the weight rows of all k experts.

At batch 1 a token's k pairs hit k distinct experts, so there is nothing to group: layers.moe_kernel's block
kernels would sort the pairs (a launch), pad each to a 16-row tensor-core tile, and add the k outputs in a launch
of their own. Here two launches do it all, each program taking one token and a few columns of all k experts at once
(k weight tiles in flight together, the token's row loaded once for all of them):
- `_gate_up`: silu(x . gate) * (x . up), the MoE block's RMSNorm of x summed on the way as in layers.gemv (the router
  and shared expert fold it in too, so the block runs no norm kernel);
- `_down_sum`: each pair's down product scaled by its routing weight and rounded as the block kernels round it, the
  k of them added in k order, then the gated shared expert and the residual (moe_kernel.finish_token).
The tiles change how a dot's float32 lanes are summed (a few ulps), never which rows meet: batch-invariant engines
keep the block kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import pdl
from .invariant.matmul import finish
from .invariant.rounding import cast
from .moe_kernel import finish_token
from .norm import norm_flavour
from .pdl import wait_then_release


@dataclass(frozen=True)
class Launch:
    """One projection's launch: BLOCK_N columns of all k experts per program, BLOCK_K-wide steps along the input."""

    block_n: int
    block_k: int
    num_warps: int = 4


@dataclass(frozen=True)
class Tiles:
    gate_up: Launch
    down: Launch


def tiles(device: torch.device) -> Tiles:
    """From `python -m pocketlab.tools.moe_bench --sweep` at both MoE shapes (reports/gpu/moe-experts-*); the
    interpreter keeps small tiles (tails in both directions at test shapes)."""
    if device.type != "cuda":
        return Tiles(Launch(2, 32), Launch(2, 16))
    return Tiles(Launch(2, 256), Launch(2, 128))


@triton.jit
def _gate_up(x_ptr, w_ptr, sw_ptr, g_ptr, ids_ptr, h_ptr, eps, H, I, stride_x, stride_we, stride_wn, stride_sn,
             TOP_K: tl.constexpr, NORM: tl.constexpr, KP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             SHARED: tl.constexpr, IDS_READY: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """h[pair j, n] = silu(x . gate[e_j, n]) * (x . up[e_j, n]) for the token's k pairs and this program's columns:
    float32 lanes [KP, BLOCK_N, BLOCK_K] along H, summed once; NORM (layers.gemv's flavours): x is RMS-normed with
    weight g first. SHARED: the shared expert's [gate | up] (sw, as wide as an expert) too, into h's row N * k +
    token. Weight tiles load a step ahead of their use; the shared expert's first before the PDL wait, the routed
    experts' first after it, as the routing kernel just before writes the expert ids, or before it with IDS_READY
    (the routing ran two or more launches back)."""
    token = tl.program_id(1).to(tl.int64)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    if SHARED:
        shared_gate_rows = sw_ptr + n.to(tl.int64)[:, None] * stride_sn
        shared_up_rows = shared_gate_rows + I * stride_sn
        shared_gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        shared_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        shared_gate_w = tl.load(shared_gate_rows + k[None, :], mask=(n < I)[:, None] & (k < H)[None, :], other=0.0)
        shared_up_w = tl.load(shared_up_rows + k[None, :], mask=(n < I)[:, None] & (k < H)[None, :], other=0.0)
    if not IDS_READY:
        wait_then_release(PDL)
    j = tl.arange(0, KP)
    live = (j < TOP_K)[:, None, None] & (n < I)[None, :, None]
    e = tl.load(ids_ptr + token * TOP_K + j, mask=j < TOP_K, other=0).to(tl.int64)
    gate_rows = w_ptr + e[:, None, None] * stride_we + n.to(tl.int64)[None, :, None] * stride_wn
    up_rows = gate_rows + I * stride_wn
    gate_w = tl.load(gate_rows + k[None, None, :], mask=live & (k < H)[None, None, :], other=0.0)
    up_w = tl.load(up_rows + k[None, None, :], mask=live & (k < H)[None, None, :], other=0.0)
    if IDS_READY:
        wait_then_release(PDL)
    lanes_gate = tl.zeros((KP, BLOCK_N, BLOCK_K), dtype=tl.float32)
    lanes_up = tl.zeros((KP, BLOCK_N, BLOCK_K), dtype=tl.float32)
    squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        ahead = live & (k + BLOCK_K < H)[None, None, :]
        gate_next = tl.load(gate_rows + (k + BLOCK_K)[None, None, :], mask=ahead, other=0.0)
        up_next = tl.load(up_rows + (k + BLOCK_K)[None, None, :], mask=ahead, other=0.0)
        if SHARED:
            shared_ahead = (n < I)[:, None] & (k + BLOCK_K < H)[None, :]
            shared_gate_next = tl.load(shared_gate_rows + (k + BLOCK_K)[None, :], mask=shared_ahead, other=0.0)
            shared_up_next = tl.load(shared_up_rows + (k + BLOCK_K)[None, :], mask=shared_ahead, other=0.0)
        x = tl.load(x_ptr + token * stride_x + k, mask=k < H, other=0.0).to(tl.float32)
        if NORM:
            squares += x * x
            x = x * (tl.load(g_ptr + k, mask=k < H, other=0.0).to(tl.float32) + (1.0 if NORM == 2 else 0.0))
        lanes_gate += x[None, None, :] * gate_w.to(tl.float32)
        lanes_up += x[None, None, :] * up_w.to(tl.float32)
        gate_w, up_w = gate_next, up_next
        if SHARED:
            shared_gate += x[None, :] * shared_gate_w.to(tl.float32)
            shared_up += x[None, :] * shared_up_w.to(tl.float32)
            shared_gate_w, shared_up_w = shared_gate_next, shared_up_next
    gate, up = tl.sum(lanes_gate, axis=2), tl.sum(lanes_up, axis=2)
    inv_rms = tl.rsqrt(tl.sum(squares, axis=0) / H + eps) if NORM else 1.0
    dtype = h_ptr.dtype.element_ty
    y = finish(gate * inv_rms, up * inv_rms, h_ptr, h_ptr, j, n, j < TOP_K, n < I, 0, dtype, False, 2)  # SwiGLU
    pairs = token * TOP_K + j
    tl.store(h_ptr + pairs[:, None] * I + n[None, :], y, mask=(j < TOP_K)[:, None] & (n < I)[None, :])
    if SHARED:
        one = tl.arange(0, 1)
        shared_gate = tl.sum(shared_gate, axis=1)[None, :] * inv_rms
        shared_up = tl.sum(shared_up, axis=1)[None, :] * inv_rms
        y = finish(shared_gate, shared_up, h_ptr, h_ptr, one, n, one < 1, n < I, 0, dtype, False, 2)
        row = tl.num_programs(1) * TOP_K + token
        tl.store(h_ptr + row * I + n[None, :], y, mask=(n < I)[None, :])


@triton.jit
def _down_sum(h_ptr, w_ptr, sw_ptr, weights_ptr, ids_ptr, out_ptr, shared_ptr, gate_ptr, residual_ptr, H, I,
              stride_we, stride_wn, stride_sn, stride_s, stride_g, stride_r, TOP_K: tl.constexpr, KP: tl.constexpr,
              SHARED: tl.constexpr, SHARED_W: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """out[token, n] for this program's columns: the k products cast(weight_j * (h[pair j] . down[e_j, n])) (float32
    lanes along I, summed once) added in k order in float32, then finish_token with the shared expert's output:
    read from `shared` (SHARED), or SHARED_W: its down product (sw, on h's row N * k + token) in this launch,
    rounded once as the plain GEMV rounds it. The expert ids, routing weights and first weight tiles load before
    the PDL wait (the routing ran two or more launches back); h and the rest after."""
    token = tl.program_id(1).to(tl.int64)
    j = tl.arange(0, KP)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = (j < TOP_K)[:, None, None] & (n < H)[None, :, None]
    pairs = token * TOP_K + j
    e = tl.load(ids_ptr + pairs, mask=j < TOP_K, other=0).to(tl.int64)
    rows = w_ptr + e[:, None, None] * stride_we + n.to(tl.int64)[None, :, None] * stride_wn
    k = tl.arange(0, BLOCK_K)
    w = tl.load(rows + k[None, None, :], mask=live & (k < I)[None, None, :], other=0.0)
    if SHARED_W:
        shared_rows = sw_ptr + n.to(tl.int64)[:, None] * stride_sn
        shared_row = tl.num_programs(1) * TOP_K + token  # its h row
        shared_lanes = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        shared_w = tl.load(shared_rows + k[None, :], mask=(n < H)[:, None] & (k < I)[None, :], other=0.0)
    routing = tl.load(weights_ptr + pairs, mask=j < TOP_K, other=0.0).to(tl.float32)
    wait_then_release(PDL)
    lanes = tl.zeros((KP, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        w_next = tl.load(rows + (k + BLOCK_K)[None, None, :], mask=live & (k + BLOCK_K < I)[None, None, :], other=0.0)
        h = tl.load(h_ptr + pairs[:, None] * I + k[None, :], mask=(j < TOP_K)[:, None] & (k < I)[None, :], other=0.0)
        lanes += h.to(tl.float32)[:, None, :] * w.to(tl.float32)
        w = w_next
        if SHARED_W:
            shared_ahead = (n < H)[:, None] & (k + BLOCK_K < I)[None, :]
            shared_next = tl.load(shared_rows + (k + BLOCK_K)[None, :], mask=shared_ahead, other=0.0)
            shared_h = tl.load(h_ptr + shared_row * I + k, mask=k < I, other=0.0).to(tl.float32)
            shared_lanes += shared_h[None, :] * shared_w.to(tl.float32)
            shared_w = shared_next
    products = cast(tl.sum(lanes, axis=2) * routing[:, None], out_ptr.dtype.element_ty).to(tl.float32)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for i in tl.static_range(TOP_K):  # k order: adding the zeros of the other pairs is exact
        acc += tl.sum(tl.where((j == i)[:, None], products, 0.0), axis=0)
    shared_sum = tl.sum(shared_lanes, axis=1) if SHARED_W else acc
    store_token(acc, shared_sum, token, n, H, out_ptr, shared_ptr, gate_ptr, residual_ptr, stride_s, stride_g,
                stride_r, SHARED, SHARED_W, RESIDUAL)  # fmt: skip


@triton.jit
def store_token(acc, shared_sum, token, n, H, out_ptr, shared_ptr, gate_ptr, residual_ptr, stride_s, stride_g,
                stride_r, SHARED: tl.constexpr, SHARED_W: tl.constexpr, RESIDUAL: tl.constexpr):  # fmt: skip
    """out[token, n] = finish_token of the k-sum acc, with the shared expert's output: its down sum (float32,
    SHARED_W) rounded once as the plain GEMV rounds it, or read from `shared` (SHARED)."""
    dtype = out_ptr.dtype.element_ty
    if SHARED_W:
        shared = cast(shared_sum, dtype).to(tl.float32)
    elif SHARED:
        shared = tl.load(shared_ptr + token * stride_s + n, mask=n < H, other=0.0).to(tl.float32)
    else:
        shared = acc
    y = finish_token(acc, token, n, n < H, shared, gate_ptr, residual_ptr, stride_g, stride_r, dtype,
                     SHARED or SHARED_W, RESIDUAL)  # fmt: skip
    tl.store(out_ptr + token * H + n, y, mask=n < H)


def gemv_experts(x, gate_up, down, weights, ids, residual=None, shared=None, shared_gate=None, norm=None,
                 t: Tiles | None = None, ids_ready: bool = False, shared_weights=None):  # fmt: skip
    """moe_kernel.fused_experts' contract (x [N, H], gate_up [E, 2I, H], down [E, H, I], weights/ids [N, k]; the
    residual and the gated shared expert added in the last launch), for decode's few tokens; `norm` (a
    layers.norm.RMSNorm of width H): the experts read norm(x), normed in the gate_up launch. t: the launches' tiles
    (default `tiles(...)`; the bench's sweep passes others). ids_ready: ids and weights were written two or more
    launches back (the shared expert ran between), so gate_up may read them before its PDL wait. shared_weights
    (the shared expert's [gate | up] [2I, H] and down [H, I], as wide as an expert) in place of `shared`: the shared
    expert runs in the same two launches."""
    check(gate_up, down, shared, shared_gate, shared_weights)
    t = t or tiles(x.device)
    h = gate_up_sums(x, gate_up, ids, norm, t.gate_up, ids_ready, shared_weights)
    return down_sum(h, down, weights, ids, shared, shared_gate, residual, t.down, shared_weights)


def check(gate_up, down, shared, shared_gate, shared_weights) -> None:
    """The weight layouts the experts' launches read, and a shared expert given one way only."""
    two_i, H = gate_up.shape[1:]
    if gate_up.stride(2) != 1 or down.stride(2) != 1:
        raise ValueError("gemv_experts needs expert weights contiguous along their input dimension")
    if shared_weights is not None:
        if shared is not None or shared_gate is None:
            raise ValueError("gemv_experts: shared_weights replace `shared` and need `shared_gate`")
        shapes = tuple(tuple(w.shape) for w in shared_weights)
        if shapes != ((two_i, H), (H, two_i // 2)):
            raise ValueError(
                f"gemv_experts: shared expert {shapes} is not as wide as an expert {((two_i, H), (H, two_i // 2))}"
            )


def gate_up_sums(x, gate_up, ids, norm, launch: Launch, ids_ready: bool = False, shared_weights=None) -> torch.Tensor:
    """The gate_up launch of gemv_experts (`_gate_up`): h [N * k (+ N), I], the shared expert's rows last."""
    (N, top_k), (_, two_i, H) = ids.shape, gate_up.shape
    x, ids = x.contiguous(), ids.contiguous()
    h = torch.empty(N * top_k + (N if shared_weights is not None else 0), two_i // 2, dtype=x.dtype, device=x.device)
    if not N:
        return h
    shared_gu = gate_up[0] if shared_weights is None else shared_weights[0]
    _gate_up[(triton.cdiv(two_i // 2, launch.block_n), N)](
        x, gate_up, shared_gu, x if norm is None else norm.weight, ids, h, 0.0 if norm is None else norm.eps, H,
        two_i // 2, x.stride(0), gate_up.stride(0), gate_up.stride(1), shared_gu.stride(0), TOP_K=top_k,
        NORM=norm_flavour(norm), KP=triton.next_power_of_2(top_k), BLOCK_N=launch.block_n, BLOCK_K=launch.block_k,
        SHARED=shared_weights is not None, IDS_READY=ids_ready, num_warps=launch.num_warps, **pdl.launch(x.device),
    )  # fmt: skip
    return h


def down_sum(h, down, weights, ids, shared, shared_gate, residual, launch: Launch, shared_weights=None) -> torch.Tensor:
    """The down launch of gemv_experts (`_down_sum`): total [N, H] from h [N * k (+ N), I], the gate_up launch's
    output (its last N rows the shared expert's where shared_weights are given)."""
    (N, top_k), H, I = ids.shape, down.shape[1], down.shape[2]  # noqa: E741
    total = torch.empty(N, H, dtype=h.dtype, device=h.device)
    if not N:
        return total
    weights, ids = weights.contiguous(), ids.contiguous()
    shared_down = down[0] if shared_weights is None else shared_weights[1]
    s, g, r = (total if a is None else a for a in (shared, shared_gate, residual))  # absent: a pointer never read
    _down_sum[(triton.cdiv(H, launch.block_n), N)](
        h, down, shared_down, weights, ids, total, s, g, r, H, I, down.stride(0), down.stride(1),
        shared_down.stride(0), s.stride(0), g.stride(0), r.stride(0), TOP_K=top_k, KP=triton.next_power_of_2(top_k),
        SHARED=shared is not None, SHARED_W=shared_weights is not None, RESIDUAL=residual is not None,
        BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, num_warps=launch.num_warps, **pdl.launch(h.device),
    )  # fmt: skip
    return total
