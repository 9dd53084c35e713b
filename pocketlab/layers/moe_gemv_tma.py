"""An experiment: layers.moe_gemv.gemv_experts with its gate_up launch reading the experts' weights through a TMA ring
in shared memory (layers.gemv_tma's form): one program per (token pair, columns), its expert's gate and up rows two
tiles a step. moe_gemv's gate_up holds all k experts' tiles in registers (252 a thread on sm_90); this form takes
25-120 (`python -m pocketlab.layers.gemv_sweep --resources`). `python -m pocketlab.tools.moe_bench` times it as path
"gemv_tma" beside "gemv"; the down launch is gemv_experts' own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import moe_gemv, pdl
from .gemv_tma import Ring
from .invariant.matmul import finish
from .pdl import wait_then_release


@triton.jit
def _expert_gate_up_tma(x_ptr, w_desc, ids_ptr, h_ptr, I, H, stride_x, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """h[pair, n] = silu(x . gate[e, n]) * (x . up[e, n]) for the pair program_id(1) (token pair // TOP_K, expert
    e = ids[pair]) and this program's BLOCK_N columns, gate_up read as [E * 2I, H]: two tiles a step. Columns past I
    read the next rows (the up half, the next expert, zeros past the end) and are never stored."""
    pair = tl.program_id(1).to(tl.int64)
    n0 = tl.program_id(0) * BLOCK_N
    wait_then_release(PDL)  # the routing launch just before wrote the ids
    gate_row = tl.load(ids_ptr + pair).to(tl.int32) * 2 * I + n0
    x_row = x_ptr + (pair // TOP_K) * stride_x
    lanes_gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    lanes_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, H, BLOCK_K, num_stages=STAGES):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + k, mask=k < H, other=0.0).to(tl.float32)
        lanes_gate += w_desc.load([gate_row, k0]).to(tl.float32) * x[None, :]
        lanes_up += w_desc.load([gate_row + I, k0]).to(tl.float32) * x[None, :]
    n, m = n0 + tl.arange(0, BLOCK_N), tl.arange(0, 1)
    gate, up = tl.sum(lanes_gate, 1)[None, :], tl.sum(lanes_up, 1)[None, :]
    y = finish(gate, up, h_ptr, h_ptr, m, n, m < 1, n < I, 0, h_ptr.dtype.element_ty, False, 2)  # SwiGLU
    tl.store(h_ptr + pair * I + n[None, :], y, mask=(n < I)[None, :])


def experts_tma(x, gate_up, down, weights, ids, residual=None, shared=None, shared_gate=None, ring: Ring | None = None):
    """layers.moe_gemv.gemv_experts' contract (x [N, H], gate_up [E, 2I, H], down [E, H, I], weights/ids [N, k];
    no norm, the shared expert given as an output) with the gate_up launch through a TMA ring per (pair, columns)."""
    (N, top_k), (E, two_i, H), ring = ids.shape, gate_up.shape, ring or Ring()
    rows = gate_up.view(E * two_i, H)  # a view: gate_up must be contiguous
    if rows.data_ptr() % 16 or (H * rows.element_size()) % 16:
        raise ValueError(f"experts_tma: TMA reads rows of 16-byte multiples from a 16-byte aligned start; H = {H}")
    x, ids = x.contiguous(), ids.contiguous()
    h = torch.empty(N * top_k, two_i // 2, dtype=x.dtype, device=x.device)
    total = torch.empty(N, H, dtype=x.dtype, device=x.device)
    if not N:
        return total
    desc = TensorDescriptor.from_tensor(rows, block_shape=[ring.block_n, ring.block_k])
    _expert_gate_up_tma[(triton.cdiv(two_i // 2, ring.block_n), N * top_k)](
        x, desc, ids, h, two_i // 2, H, x.stride(0), TOP_K=top_k, BLOCK_N=ring.block_n, BLOCK_K=ring.block_k,
        STAGES=ring.stages, num_warps=ring.num_warps, **pdl.launch(x.device),
    )  # fmt: skip
    down_launch = moe_gemv.tiles(x.device).down
    return moe_gemv.down_sum(h, down, weights.contiguous(), ids, total, shared, shared_gate, residual, down_launch)
