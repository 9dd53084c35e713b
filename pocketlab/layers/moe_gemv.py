"""The routed experts of a decode step's one token (or few): each (token, k) pair streams its expert's weight rows.

At batch 1 a token's k pairs hit k distinct experts, so there is nothing to group: layers.moe_kernel's block
kernels would sort the pairs (a launch), pad each to a 16-row tensor-core tile, and add the k outputs in a launch
of their own. Here two launches do it all:
- gate_up: layers.gemv, a program per (pair, columns) of its expert's [gate | up] with SiLU * mul in the epilogue,
  and the MoE block's RMSNorm of x in the same launch (the router and shared expert fold it in too: no norm kernel);
- `_down_sum`: per token and output columns, the k experts' down rows in k order, each product scaled by its routing
  weight and rounded as the block kernels round it, then the gated shared expert and the residual
  (moe_kernel.finish_token, moe.combine's roundings).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import gemv, pdl
from .invariant.matmul import SWIGLU
from .invariant.rounding import cast
from .moe_kernel import finish_token
from .pdl import wait_then_release


@triton.jit
def _down_sum(h_ptr, w_ptr, weights_ptr, ids_ptr, out_ptr, shared_ptr, gate_ptr, residual_ptr, H, I, stride_we,
              stride_wn, stride_s, stride_g, stride_r, TOP_K: tl.constexpr, SHARED: tl.constexpr,
              RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """out[token, n] for this program's BLOCK_N columns: sum over j in k order of cast(weight_j * (h[pair j] .
    down[e_j, n])), each dot in float32 lanes along I summed once, then finish_token. Expert ids and routing weights
    come from the routing kernel, so every read is after the PDL wait."""
    wait_then_release(PDL)
    token = tl.program_id(1).to(tl.int64)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = n < H
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = token * TOP_K + j
        rows = w_ptr + tl.load(ids_ptr + pair).to(tl.int64) * stride_we + n.to(tl.int64)[:, None] * stride_wn
        lanes = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            h = tl.load(h_ptr + pair * I + k, mask=k < I, other=0.0).to(tl.float32)
            w = tl.load(rows + k[None, :], mask=live[:, None] & (k < I)[None, :], other=0.0)
            lanes += h[None, :] * w.to(tl.float32)
        acc += cast(tl.sum(lanes, axis=1) * tl.load(weights_ptr + pair).to(tl.float32), dtype).to(tl.float32)
    y = finish_token(acc, token, n, live, shared_ptr, gate_ptr, residual_ptr, stride_s, stride_g, stride_r, dtype,
                     SHARED, RESIDUAL)  # fmt: skip
    tl.store(out_ptr + token * H + n, y, mask=live)


def gemv_experts(x, gate_up, down, weights, ids, residual=None, shared=None, shared_gate=None, norm=None):
    """moe_kernel.fused_experts' contract (x [N, H], gate_up [E, 2I, H], down [E, H, I], weights/ids [N, k]; the
    residual and the gated shared expert added in the last launch), for decode's few tokens; `norm` (a
    layers.norm.RMSNorm of width H): the experts read norm(x), normed in the gate_up launch."""
    N, top_k = ids.shape
    E, two_i, H = gate_up.shape
    I = two_i // 2  # noqa: E741
    if gate_up.stride(2) != 1 or down.stride(2) != 1:
        raise ValueError("gemv_experts needs expert weights contiguous along their input dimension")
    x = x.contiguous()
    h = torch.empty(N * top_k, I, dtype=x.dtype, device=x.device)
    total = torch.empty(N, H, dtype=x.dtype, device=x.device)
    if not N:
        return total
    t = gemv.launch_for(1, I, H, x.device)
    gemv.launch(x, gate_up, None, h, t, SWIGLU, norm=norm, ids=ids.contiguous())
    t = gemv.launch_for(1, H, I, x.device)
    s, g, r = (total if a is None else a for a in (shared, shared_gate, residual))  # absent: a pointer never read
    _down_sum[(triton.cdiv(H, t.block_n), N)](
        h, down, weights.contiguous(), ids.contiguous(), total, s, g, r, H, I, down.stride(0), down.stride(1),
        s.stride(0), g.stride(0), r.stride(0), TOP_K=top_k, SHARED=shared is not None,
        RESIDUAL=residual is not None, BLOCK_N=t.block_n, BLOCK_K=t.block_k, num_warps=t.num_warps,
        **pdl.launch(x.device),
    )  # fmt: skip
    return total
