"""An experiment: layers.moe_gemv.gemv_experts with its gate_up launch reading the experts' weights through a TMA ring
in shared memory (layers.gemv_tma's form): one program per (token pair, columns), its expert's gate and up rows two
tiles a step, the block's norm and the shared expert included. moe_gemv's gate_up holds all k experts' tiles in
registers (252 a thread on sm_90); this form takes far fewer (`python -m pocketlab.layers.gemv_sweep --resources`).
`python -m pocketlab.tools.moe_bench` times it as path "gemv_tma" beside "gemv"; POCKETLAB_MOE_TMA sends the engine's
decode experts here (`few_experts`), for tools.ab; POCKETLAB_MOE_TMA_DOWN does the same for the down launch, whose
programs (token, columns) stream the k pairs' down rows through one ring, pair after pair.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import gemv_tma, moe_gemv, pdl
from .gemv_tma import DEFAULT_RING, Ring, ring_sums
from .invariant.matmul import finish
from .invariant.rounding import cast
from .moe_gemv import store_token
from .norm import norm_flavour
from .pdl import wait_then_release


@triton.jit
def _expert_gate_up_tma(x_ptr, w_desc, s_desc, g_ptr, ids_ptr, h_ptr, eps, I, H, stride_x, PAIRS,
                        TOP_K: tl.constexpr, NORM: tl.constexpr, SHARED: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """h[pair, n] = silu(x . gate[e, n]) * (x . up[e, n]) for the pair program_id(1) (token pair // TOP_K, expert
    e = ids[pair]) and this program's BLOCK_N columns, gate_up read as [E * 2I, H]; with SHARED the programs past the
    PAIRS routed pairs compute the shared expert's rows (s_desc, [2I, H]) for token pair - PAIRS, h's row N * k +
    token as in moe_gemv. NORM: x is the block's RMSNorm of the token's row, taken on the way. Columns past I read the
    next rows (the up half, the next expert, zeros past the end) and are never stored."""
    pair = tl.program_id(1).to(tl.int64)
    n0 = tl.program_id(0) * BLOCK_N
    wait_then_release(PDL)  # the routing launch just before wrote the ids
    if SHARED and pair >= PAIRS:
        x_row = x_ptr + (pair - PAIRS) * stride_x
        first, first_up = s_desc.load([n0, 0]), s_desc.load([n0 + I, 0])
        gate, up, squares = ring_sums(s_desc, n0, n0 + I, x_row, g_ptr, H, first, first_up, NORM, True, BLOCK_N,
                                      BLOCK_K, STAGES)  # fmt: skip
    else:
        x_row = x_ptr + (pair // TOP_K) * stride_x
        gate_row = tl.load(ids_ptr + pair).to(tl.int32) * 2 * I + n0
        first, first_up = w_desc.load([gate_row, 0]), w_desc.load([gate_row + I, 0])
        gate, up, squares = ring_sums(w_desc, gate_row, gate_row + I, x_row, g_ptr, H, first, first_up, NORM, True,
                                      BLOCK_N, BLOCK_K, STAGES)  # fmt: skip
    inv_rms = tl.rsqrt(squares / H + eps) if NORM else 1.0
    n, m = n0 + tl.arange(0, BLOCK_N), tl.arange(0, 1)
    y = finish((gate * inv_rms)[None, :], (up * inv_rms)[None, :], h_ptr, h_ptr, m, n, m < 1, n < I, 0,
               h_ptr.dtype.element_ty, False, 2)  # SwiGLU  # fmt: skip
    tl.store(h_ptr + pair * I + n[None, :], y, mask=(n < I)[None, :])


@triton.jit
def _expert_down_tma(h_ptr, w_desc, s_desc, weights_ptr, ids_ptr, out_ptr, shared_ptr, gate_ptr, residual_ptr, H, I,
                     stride_s, stride_g, stride_r, TOP_K: tl.constexpr, KP: tl.constexpr, SHARED: tl.constexpr,
                     SHARED_W: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     STAGES: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """moe_gemv._down_sum's out[token, n] for this program's BLOCK_N columns (token program_id(1)), the k pairs' down
    rows (down read as [E * H, I]) streamed pair after pair through one ring: each pair's float32 lanes summed once
    and rounded with its routing weight, the k products added in k order, then moe_gemv.store_token. SHARED_W: the
    shared expert's down rows (s_desc, [H, I]) against h's row N * k + token, through a ring of their own. The
    first pair's id and tile load before the PDL wait (the routing ran two launches back)."""
    token = tl.program_id(1).to(tl.int64)
    n0 = tl.program_id(0) * BLOCK_N
    k, j = tl.arange(0, BLOCK_K), tl.arange(0, KP)
    tiles = tl.cdiv(I, BLOCK_K)  # per pair
    first = w_desc.load([tl.load(ids_ptr + token * TOP_K).to(tl.int32) * H + n0, 0])
    routing = tl.load(weights_ptr + token * TOP_K + j, mask=j < TOP_K, other=0.0).to(tl.float32)
    wait_then_release(PDL)
    dtype = out_ptr.dtype.element_ty
    h = tl.load(h_ptr + token * TOP_K * I + k, mask=k < I, other=0.0).to(tl.float32)
    lanes = first.to(tl.float32) * h[None, :]
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for t in tl.range(1, TOP_K * tiles, num_stages=STAGES):
        if t % tiles == 0:  # the pair before is complete
            weight = tl.sum(tl.where(j == t // tiles - 1, routing, 0.0), 0)
            acc += cast(tl.sum(lanes, 1) * weight, dtype).to(tl.float32)
            lanes = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        pair = token * TOP_K + t // tiles
        k0 = (t % tiles) * BLOCK_K
        h = tl.load(h_ptr + pair * I + k0 + k, mask=k0 + k < I, other=0.0).to(tl.float32)
        e = tl.load(ids_ptr + pair).to(tl.int32)
        lanes += w_desc.load([e * H + n0, k0]).to(tl.float32) * h[None, :]
    weight = tl.sum(tl.where(j == TOP_K - 1, routing, 0.0), 0)
    acc += cast(tl.sum(lanes, 1) * weight, dtype).to(tl.float32)
    if SHARED_W:
        shared_h = h_ptr + (tl.num_programs(1) * TOP_K + token) * I
        shared_lanes = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in tl.range(0, I, BLOCK_K, num_stages=STAGES):
            h = tl.load(shared_h + k0 + k, mask=k0 + k < I, other=0.0).to(tl.float32)
            shared_lanes += s_desc.load([n0, k0]).to(tl.float32) * h[None, :]
    shared_sum = tl.sum(shared_lanes, 1) if SHARED_W else acc
    store_token(acc, shared_sum, token, n0 + tl.arange(0, BLOCK_N), H, out_ptr, shared_ptr, gate_ptr, residual_ptr,
                stride_s, stride_g, stride_r, SHARED, SHARED_W, RESIDUAL)  # fmt: skip


def fits(*weights: torch.Tensor) -> bool:
    """Every weight contiguous, its rows TMA-readable (layers.gemv_tma.fits)."""
    return all(w.is_contiguous() and gemv_tma.fits(w.view(-1, w.shape[-1])) for w in weights)


def experts_tma(x, gate_up, down, weights, ids, residual=None, shared=None, shared_gate=None, norm=None,
                t: moe_gemv.Tiles | None = None, ids_ready: bool = False, shared_weights=None,
                ring: Ring | None = DEFAULT_RING, down_ring: Ring | None = None):  # fmt: skip
    """layers.moe_gemv.gemv_experts' contract, each of its two launches through a TMA ring where one is given (`ring`:
    gate_up's, a program per (pair, columns), the shared expert's [gate | up] as N more pairs; `down_ring`: the
    down's, a program per (token, columns)), else gemv_experts' own launch (tiles t). ids_ready: as gemv_experts
    reads it, for its own gate_up launch (the ring's starts after the PDL wait)."""
    moe_gemv.check(gate_up, down, shared, shared_gate, shared_weights)
    ring_weights = ([gate_up] if ring else []) + ([down] if down_ring else [])
    ring_weights += [w for w, r in zip(shared_weights or (), (ring, down_ring), strict=False) if r]
    if not fits(*ring_weights):
        raise ValueError(f"experts_tma: TMA reads contiguous rows of 16-byte multiples from a 16-byte aligned start; "
                         f"weights {[tuple(w.shape) for w in ring_weights]}")  # fmt: skip
    t = t or moe_gemv.tiles(x.device)
    if ring is None:
        h = moe_gemv.gate_up_sums(x, gate_up, ids, norm, t.gate_up, ids_ready, shared_weights)
    else:
        h = gate_up_tma(x, gate_up, ids, norm, ring, shared_weights)
    if down_ring is None:
        return moe_gemv.down_sum(h, down, weights, ids, shared, shared_gate, residual, t.down, shared_weights)
    return down_tma(h, down, weights, ids, shared, shared_gate, residual, down_ring, shared_weights)


def gate_up_tma(x, gate_up, ids, norm, ring: Ring, shared_weights=None) -> torch.Tensor:
    """moe_gemv.gate_up_sums' h through `_expert_gate_up_tma`."""
    (N, top_k), (E, two_i, H) = ids.shape, gate_up.shape
    x, ids = x.contiguous(), ids.contiguous()
    inside = shared_weights is not None
    h = torch.empty(N * top_k + (N if inside else 0), two_i // 2, dtype=x.dtype, device=x.device)
    if not N:
        return h
    rows = TensorDescriptor.from_tensor(gate_up.view(E * two_i, H), block_shape=[ring.block_n, ring.block_k])
    own = TensorDescriptor.from_tensor(shared_weights[0], block_shape=[ring.block_n, ring.block_k]) if inside else rows
    _expert_gate_up_tma[(triton.cdiv(two_i // 2, ring.block_n), h.shape[0])](
        x, rows, own, x if norm is None else norm.weight, ids, h, 0.0 if norm is None else norm.eps, two_i // 2, H,
        x.stride(0), N * top_k, TOP_K=top_k, NORM=norm_flavour(norm), SHARED=inside, BLOCK_N=ring.block_n,
        BLOCK_K=ring.block_k, STAGES=ring.stages, num_warps=ring.num_warps, **pdl.launch(x.device),
    )  # fmt: skip
    return h


def down_tma(h, down, weights, ids, shared, shared_gate, residual, ring: Ring, shared_weights=None) -> torch.Tensor:
    """moe_gemv.down_sum's total [N, H] through `_expert_down_tma`."""
    (N, top_k), (E, H, I) = ids.shape, down.shape  # noqa: E741
    total = torch.empty(N, H, dtype=h.dtype, device=h.device)
    if not N:
        return total
    weights, ids = weights.contiguous(), ids.contiguous()
    rows = TensorDescriptor.from_tensor(down.view(E * H, I), block_shape=[ring.block_n, ring.block_k])
    inside = shared_weights is not None
    own = TensorDescriptor.from_tensor(shared_weights[1], block_shape=[ring.block_n, ring.block_k]) if inside else rows
    s, g, r = (total if a is None else a for a in (shared, shared_gate, residual))  # absent: a pointer never read
    _expert_down_tma[(triton.cdiv(H, ring.block_n), N)](
        h, rows, own, weights, ids, total, s, g, r, H, I, s.stride(0), g.stride(0), r.stride(0), TOP_K=top_k,
        KP=triton.next_power_of_2(top_k), SHARED=shared is not None, SHARED_W=inside, RESIDUAL=residual is not None,
        BLOCK_N=ring.block_n, BLOCK_K=ring.block_k, STAGES=ring.stages, num_warps=ring.num_warps,
        **pdl.launch(h.device),
    )  # fmt: skip
    return total


def few_experts(*args, **kwargs) -> torch.Tensor:
    """The engine's experts for decode's few tokens: moe_gemv.gemv_experts, or with POCKETLAB_MOE_TMA (gate_up) and
    POCKETLAB_MOE_TMA_DOWN (down), switches for measuring read as layers.gemv_tma.ring_from_env reads them, those
    launches through rings where the weights fit them."""
    ring, down_ring = gemv_tma.ring_from_env("POCKETLAB_MOE_TMA"), gemv_tma.ring_from_env("POCKETLAB_MOE_TMA_DOWN")
    gate_up, down, shared_weights = args[1], args[2], kwargs.get("shared_weights") or ()
    ring = ring if fits(gate_up, *shared_weights[:1]) else None
    down_ring = down_ring if fits(down, *shared_weights[1:]) else None
    if ring is None and down_ring is None:
        return moe_gemv.gemv_experts(*args, **kwargs)
    return experts_tma(*args, **kwargs, ring=ring, down_ring=down_ring)  # type: ignore[misc]  # kwargs holds no ring
