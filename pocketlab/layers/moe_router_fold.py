"""At one token: the MoE block's router and routing inside the launch before it (o_proj, or the Gated DeltaNet's
out_proj), which writes the residual stream h the router reads.

Unfused, a sparse block's decode step opens with two small launches, the router's GEMV (a 0.5 MiB weight at
Qwen3-30B-A3B) and the routing, each costing a launch's ramp and drain for almost no bytes. Here each program of the
out projection, once it holds its columns of h, also takes those columns' share of every router dot product:
logit[e] = rsqrt(mean(h^2) + eps) * sum_n h[n] g[n] R[e, n], whose sum over n splits into per-program parts. The
parts are added as integers (fixed point, 2^-FIXED_BITS), so their order, which varies from run to run, cannot
change a bit; the last program to arrive sums h's squares, scales, rounds the logits to the dtype (as the router's
own launch rounds them) and routes as layers.moe_kernel's one-launch routing does.
The logits differ from the router's own launch by the order of the float32 sums only (a few ulps before the one
rounding): where experts nearly tie, either path's pick is a right answer. Batch-invariant engines keep the
unfused launches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from . import pdl
from .arrivals import arrival_counts
from .gemv import Launch, _tile
from .invariant.matmul import finish
from .invariant.rounding import cast
from .moe_kernel import top_experts
from .norm import RMSNorm, norm_flavour
from .pdl import wait_then_release

FIXED_BITS = 24  # a part's resolution 2^-24; its magnitude may reach 2^39 before an int64 sum could overflow


@dataclass
class RouterFold:
    """What the out projection needs to route its token too: the router weight transposed ([H, E (+1 shared gate
    row)], each program's columns contiguous), the block's norm (weight, eps, flavour), the routing's arguments,
    and a zeroed int64 sum per logit that every launch leaves zeroed again (so CUDA graphs replay it). `routed`
    hands the result to the block: (the projection's output, logits, weights, ids)."""

    router_t: torch.Tensor
    norm: RMSNorm  # of width H
    num_experts: int
    top_k: int
    renormalize: bool
    sums: torch.Tensor = field(init=False)
    routed: tuple | None = field(default=None, init=False)

    def __post_init__(self):
        self.sums = torch.zeros(self.router_t.shape[1], dtype=torch.int64, device=self.router_t.device)

    def take(self, h: torch.Tensor) -> tuple | None:
        """(logits, weights, ids) routed for the block input h, if the launch that wrote h routed it; else None.
        Either way the hand-off is emptied, so nothing routed for one tensor ever serves another."""
        routed, self.routed = self.routed, None
        return routed[1:] if routed is not None and routed[0] is h else None


def launch_for(N: int, device: torch.device) -> Launch:
    """Tiles of 8 weight rows (a quarter of the programs layers.gemv takes at o_proj, so a quarter of the atomic
    adds), 512 wide; the interpreter's small tiles reach the tails."""
    return Launch(1, 8, 512, 4) if device.type == "cuda" else Launch(1, 8, 64, 4)


@triton.jit
def _project_and_route(x_ptr, w_ptr, res_ptr, y_ptr, rt_ptr, g_ptr, sums_ptr, arrived_ptr, logits_ptr, weights_ptr,
                       ids_ptr, eps, N, K, E_ALL, NUM_EXPERTS, stride_wn, TOP_K: tl.constexpr,
                       RENORMALIZE: tl.constexpr, NORM: tl.constexpr, FIXED: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_TOP: tl.constexpr,
                       PDL: tl.constexpr):  # fmt: skip
    """y[n] = residual[n] + x . W[n] for this program's BLOCK_N rows (float32 lanes along K, rounded as layers.gemv
    rounds), then their share of the router's sums, added into `sums` as integers; the last program to arrive
    turns the sums into logits and routes (module docstring). The router's and the norm's weights, and W's first
    tile, load before the PDL wait."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    live_n = n < N
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    k = tl.arange(0, BLOCK_K)
    w = _tile(w_rows, k, live_n, K)
    e = tl.arange(0, BLOCK_E)
    live_e = e < E_ALL
    router = tl.load(rt_ptr + n[:, None] * E_ALL + e[None, :], mask=live_n[:, None] & live_e[None, :], other=0.0)
    g = tl.load(g_ptr + n, mask=live_n, other=0.0).to(tl.float32) + (1.0 if NORM == 2 else 0.0)
    wait_then_release(PDL)
    lanes = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        w_next = _tile(w_rows, k + BLOCK_K, live_n, K)
        x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        lanes += x[None, :] * w.to(tl.float32)
        w = w_next
    one = tl.arange(0, 1)
    y = finish(tl.sum(lanes, axis=1)[None, :], lanes, res_ptr, res_ptr, one, n, one < 1, live_n, 0,
               y_ptr.dtype.element_ty, False, 1)  # residual + x @ W^T  # fmt: skip
    tl.store(y_ptr + n[None, :], y, mask=live_n[None, :])
    scaled = tl.sum(y.to(tl.float32), axis=0) * g  # [BLOCK_N]: h * g, the norm but for its one scalar
    part = tl.sum(scaled[:, None] * router.to(tl.float32), axis=0)
    tl.atomic_add(sums_ptr + e, (part * (1 << FIXED)).to(tl.int64), mask=live_e)
    tl.debug_barrier()  # every thread's adds and stores before the one atomic: the last to arrive sees them all
    if tl.atomic_add(arrived_ptr, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        h = tl.arange(0, BLOCK_H)
        row = tl.load(y_ptr + h, mask=h < N, other=0.0, volatile=True).to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(row * row, axis=0) / N + eps)
        sums = tl.atomic_xchg(sums_ptr + e, 0, mask=live_e)  # read, and zeroed for the next launch
        logits = cast(sums.to(tl.float32) * (1.0 / (1 << FIXED)) * inv_rms, logits_ptr.dtype.element_ty)
        tl.store(logits_ptr + e, logits, mask=live_e)
        top, which = top_experts(logits.to(tl.float32), e, NUM_EXPERTS, TOP_K, RENORMALIZE, BLOCK_E, BLOCK_TOP)
        j = tl.arange(0, BLOCK_TOP)
        tl.store(weights_ptr + j, top.to(weights_ptr.dtype.element_ty), mask=j < TOP_K)
        tl.store(ids_ptr + j, which, mask=j < TOP_K)
        tl.atomic_xchg(arrived_ptr, 0)  # ready for the next launch


def project_and_route(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, fold: RouterFold,
                      launch: Launch | None = None):  # fmt: skip
    """(residual + x @ weight^T, router logits [1, E (+1)], routing weights [1, k], expert ids [1, k]) for one
    token: x [1, K], weight [H, K] (rows contiguous), residual [1, H], in one launch."""
    (M, K), H = x.shape, weight.shape[0]
    if M != 1 or residual.shape != (1, H) or weight.shape[1] != K or fold.router_t.shape[0] != H:
        raise ValueError(f"project_and_route: one token; x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"residual {tuple(residual.shape)}, router {tuple(fold.router_t.shape)}")  # fmt: skip
    if weight.stride(1) != 1:
        raise ValueError(f"project_and_route: weight {tuple(weight.shape)} should be row-major")
    t = launch or launch_for(H, x.device)
    x, residual = x.contiguous(), residual.contiguous()
    E_all = fold.router_t.shape[1]
    y = torch.empty(1, H, dtype=x.dtype, device=x.device)
    logits = torch.empty(1, E_all, dtype=x.dtype, device=x.device)
    weights = torch.empty(1, fold.top_k, dtype=x.dtype, device=x.device)
    ids = torch.empty(1, fold.top_k, dtype=torch.int64, device=x.device)
    norm = fold.norm
    _project_and_route[(triton.cdiv(H, t.block_n),)](
        x, weight, residual, y, fold.router_t, norm.weight, fold.sums, arrival_counts(x.device, 1), logits, weights,
        ids, norm.eps, H, K, E_all, fold.num_experts, weight.stride(0), TOP_K=fold.top_k,
        RENORMALIZE=fold.renormalize, NORM=norm_flavour(norm), FIXED=FIXED_BITS, BLOCK_N=t.block_n,
        BLOCK_K=t.block_k, BLOCK_E=triton.next_power_of_2(E_all), BLOCK_H=triton.next_power_of_2(H),
        BLOCK_TOP=triton.next_power_of_2(fold.top_k), num_warps=t.num_warps, **pdl.launch(x.device),
    )  # fmt: skip
    return y, logits, weights, ids


def project_out_and_route(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, fold: RouterFold):
    """Kernels.project_out's residual + x @ weight^T for one token ([..., K] -> residual's shape), with the block's
    routing left in `fold.routed` for SparseMoE to take."""
    y, logits, weights, ids = project_and_route(x.reshape(1, -1), weight, residual.reshape(1, -1), fold)
    y = y.view(residual.shape)
    fold.routed = (y, logits, weights, ids)
    return y
