"""An experiment: layers.moe_gemv.gemv_experts with its gate_up launch reading the experts' weights through a TMA ring
in shared memory (layers.gemv_tma's form): one program per (token pair, columns), its expert's gate and up rows two
tiles a step, the block's norm and the shared expert included. moe_gemv's gate_up holds all k experts' tiles in
registers (252 a thread on sm_90); this form takes far fewer (`python -m pocketlab.layers.gemv_sweep --resources`).
`python -m pocketlab.tools.moe_bench` times it as path "gemv_tma" beside "gemv"; POCKETLAB_MOE_TMA sends the engine's
decode experts here (`few_experts`), for tools.ab. (The down launch through a ring, pair after pair, was slower at
both MoE shapes and is gone: reports/gpu/ab-moe-tma-down-*.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import gemv_tma, moe_gemv, pdl
from .gemv_tma import DEFAULT_RING, Ring, ring_sums
from .invariant.matmul import finish
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


def fits(*weights: torch.Tensor) -> bool:
    """Every weight contiguous, its rows TMA-readable (layers.gemv_tma.fits)."""
    return all(w.is_contiguous() and gemv_tma.fits(w.view(-1, w.shape[-1])) for w in weights)


def ring_reads(gate_up: torch.Tensor, shared_weights=None) -> list[torch.Tensor]:
    """The weights the gate_up ring streams: the experts' [gate | up], and the shared expert's where it runs inside."""
    return [gate_up, *(shared_weights or ())[:1]]


def experts_tma(x, gate_up, down, weights, ids, residual=None, shared=None, shared_gate=None, norm=None,
                t: moe_gemv.Tiles | None = None, shared_weights=None, ring: Ring = DEFAULT_RING):  # fmt: skip
    """layers.moe_gemv.gemv_experts' contract with its gate_up launch through the TMA ring `ring` (a program per
    (pair, columns), the shared expert's [gate | up] as N more pairs), then gemv_experts' own down launch (tiles t)."""
    moe_gemv.check(gate_up, down, shared, shared_gate, shared_weights)
    ring_weights = ring_reads(gate_up, shared_weights)
    if not fits(*ring_weights):
        raise ValueError(f"experts_tma: TMA reads contiguous rows of 16-byte multiples from a 16-byte aligned start; "
                         f"weights {[tuple(w.shape) for w in ring_weights]}")  # fmt: skip
    t = t or moe_gemv.tiles(x.device)
    h = gate_up_tma(x, gate_up, ids, norm, ring, shared_weights)
    return moe_gemv.down_sum(h, down, weights, ids, shared, shared_gate, residual, t.down, shared_weights)


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


def few_experts(*args, **kwargs) -> torch.Tensor:
    """The engine's experts for decode's few tokens: moe_gemv.gemv_experts, or with POCKETLAB_MOE_TMA, a switch for
    measuring read as layers.gemv_tma.ring_from_env reads it, the gate_up launch through that ring where the weights
    fit it (experts_tma)."""
    ring = gemv_tma.ring_from_env("POCKETLAB_MOE_TMA")
    if ring is None or not fits(*ring_reads(args[1], kwargs.get("shared_weights"))):
        return moe_gemv.gemv_experts(*args, **kwargs)
    kwargs.pop("ids_ready", None)  # the ring's gate_up reads the ids after its PDL wait
    return experts_tma(*args, **kwargs, ring=ring)  # type: ignore[misc]  # kwargs holds no ring
