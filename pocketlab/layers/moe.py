"""The mixture-of-experts block of Qwen3-MoE and Qwen3.5-MoE: router, top-k routed experts, gated shared expert.

Every token is routed on its own (softmax over all experts in float32, torch.topk, optionally renormalized: HF's
order, so its tie order too) and runs through all of its k experts: nothing is dropped for capacity, so a token's
output depends on that token alone, never on what else the batch holds (padding rows included).

The routed experts run by one of two sync-free paths (no host round trip, so decode steps can be captured in
CUDA graphs): `grouped_experts` here (pairs sorted by expert, torch grouped_mm per projection) and the Triton
kernels of layers.moe_kernel. `looped_experts` is the plain one-matmul-per-expert reference the tests compare to.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F

from .activations import swiglu
from .fused import compiled_in_graphs

_recorders: list[list[torch.Tensor]] = []


@contextlib.contextmanager
def record_routing():
    """Within this block every SparseMoE call appends its expert ids [N, k] to the yielded list, in layer order
    (eager forwards only: a replayed CUDA graph runs no Python). The bench counts the experts a step reads by it."""
    log: list[torch.Tensor] = []
    _recorders.append(log)
    try:
        yield log
    finally:
        _recorders.remove(log)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [N, k] in the logits' dtype, expert ids [N, k]) as transformers routes: softmax in float32 over
    all experts, then torch.topk (whose order decides ties), then the optional rescale to sum 1."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


@compiled_in_graphs
def sum_over_k(pairs: torch.Tensor) -> torch.Tensor:
    """[N, k, H] -> [N, H], added in k order in float32: the same adds for a token in any batch (one kernel
    inside captured decode graphs)."""
    acc = pairs[:, 0].float()
    for j in range(1, pairs.shape[1]):
        acc = acc + pairs[:, j].float()
    return acc.to(pairs.dtype)


def combine(routed, residual=None, shared=None, shared_gate=None) -> torch.Tensor:
    """[residual +] (routed [+ shared * sigmoid(shared_gate)]): the routed experts' sum, the shared expert behind its
    one gate per token [N, 1], and the residual stream, each step rounded to the dtype."""
    y = routed if shared is None else routed + shared * torch.sigmoid(shared_gate)
    return y if residual is None else residual + y


def looped_experts(x, gate_up, down, weights, ids, residual=None, shared=None, shared_gate=None) -> torch.Tensor:
    """Reference: for each expert hit, its tokens' silu(gate) * up -> down, scaled by the routing weight.
    x [N, H], gate_up [E, 2I, H], down [E, H, I], weights/ids [N, k] -> [N, H], then `combine`d with the rest.
    Host syncs: eager only."""
    N, k = ids.shape
    pairs = torch.zeros(N * k, x.shape[1], dtype=x.dtype, device=x.device)
    flat = ids.reshape(-1)
    for e in torch.unique(flat).tolist():
        rows = (flat == e).nonzero()[:, 0]
        y = F.linear(swiglu(F.linear(x[rows // k], gate_up[e])), down[e])
        pairs[rows] = y * weights.reshape(-1)[rows, None]
    return combine(sum_over_k(pairs.view(N, k, -1)), residual, shared, shared_gate)


def expert_order(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair indices sorted by expert id, stable [N*k]; tokens per expert [E] int64), without a host sync."""
    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return order, counts


# torch >= 2.10 spells it F.grouped_mm; torch._grouped_mm before
_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm_fits(x, gate_up, down) -> bool:
    """grouped_mm takes rows of 16-byte multiples (and 16-byte aligned weights), on CUDA 16-bit inputs only."""
    sizes = all(n * x.element_size() % 16 == 0 for n in (x.shape[1], down.shape[2]))
    aligned = all(t.data_ptr() % 16 == 0 for t in (gate_up, down))
    return _GROUPED_MM is not None and sizes and aligned and not (x.is_cuda and x.element_size() != 2)


def grouped_experts(x, gate_up, down, weights, ids, residual=None, shared=None, shared_gate=None) -> torch.Tensor:
    """The routed experts as two grouped matmuls (torch's grouped_mm: each expert's rows against its weight, one
    call per projection) over the (token, k) pairs sorted by expert; same arguments as `looped_experts`, whose
    loop runs the shapes grouped_mm cannot take."""
    if not grouped_mm_fits(x, gate_up, down):
        return looped_experts(x, gate_up, down, weights, ids, residual, shared, shared_gate)
    assert _GROUPED_MM is not None  # grouped_mm_fits checked it
    N, k = ids.shape
    order, counts = expert_order(ids, gate_up.shape[0])
    offs = counts.cumsum(0).to(torch.int32)
    xs = x[order // k]
    h = swiglu(_GROUPED_MM(xs, gate_up.transpose(1, 2), offs=offs))
    y = _GROUPED_MM(h, down.transpose(1, 2), offs=offs) * weights.reshape(-1)[order, None]
    pairs = torch.empty_like(y).index_copy_(0, order, y)
    return combine(sum_over_k(pairs.view(N, k, -1)), residual, shared, shared_gate)


class SparseMoE:
    """h + moe(norm(h)), a drop-in for the dense MLP of a decoder layer. p: the block's prefix ("...mlp.")."""

    def __init__(self, cfg, w: dict, p: str, kernels):
        self.top_k, self.renormalize, self.num_experts = cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.num_experts
        self.gate_up, self.down = w.pop(p + "experts.gate_up_proj"), w.pop(p + "experts.down_proj")
        self.router = w.pop(p + "gate.weight")
        self.shared = cfg.shared_expert_intermediate_size > 0
        if self.shared:  # its sigmoid gate's one row rides on the router's matmul
            self.router = torch.cat([self.router, w.pop(p + "shared_expert_gate.weight")])
            s = p + "shared_expert."
            self.shared_gate_up = torch.cat([w.pop(s + "gate_proj.weight"), w.pop(s + "up_proj.weight")])
            self.shared_down = w.pop(s + "down_proj.weight")
        self.linear = kernels.linear
        self.route, self.experts = kernels.moe_route, kernels.moe_experts
        self.few_experts, self.few_tokens = kernels.moe_few_experts, kernels.moe_few_tokens
        self.all_reduce = kernels.all_reduce  # tensor parallelism: each rank computes its slice of every expert

    @property
    def syncs_with_host(self) -> bool:
        """Whether its experts take the reference loop (torch's path where grouped_mm cannot run, as in float32 on
        CUDA), which reads the expert ids on the host: no CUDA graph can hold its forwards."""
        probe = self.gate_up.new_empty(0, self.gate_up.shape[2])
        return self.experts is grouped_experts and not grouped_mm_fits(probe, self.gate_up, self.down)

    def __call__(self, h: torch.Tensor, norm) -> torch.Tensor:
        """h + moe(norm(h)): the residual add and the shared expert's gate ride on the routed experts' last launch
        (on one device; split over ranks the partial sums are all-reduced before the residual)."""
        stream = h.reshape(-1, h.shape[-1])
        few = self.few_experts is not None and stream.shape[0] <= self.few_tokens
        if few:  # decode: each launch reading the norm runs it
            x, experts = stream, functools.partial(self.few_experts, norm=norm)
        else:  # the norm once, as its own kernel: the router, the shared expert and the experts all read it
            x, norm, experts = norm(stream), None, self.experts
        logits = self.linear(x, self.router, norm=norm)
        weights, ids = self.route(logits[:, : self.num_experts], self.top_k, self.renormalize)
        if _recorders:
            _recorders[-1].append(ids)
        shared = gate = None
        if self.shared:
            gate = logits[:, self.num_experts :]
            if few and self.shared_down.shape[1] == self.down.shape[2]:  # as wide as an expert: in their launches
                experts = functools.partial(experts, shared_weights=(self.shared_gate_up, self.shared_down))
            else:
                shared = self.linear(self.linear(x, self.shared_gate_up, swiglu=True, norm=norm), self.shared_down)
                if few:  # the routing ran two launches back: its ids may load before the PDL wait
                    experts = functools.partial(experts, ids_ready=True)
        residual = stream if self.all_reduce is None else None
        y = experts(x, self.gate_up, self.down, weights, ids, residual, shared, gate)
        if self.all_reduce is not None:
            y = stream + self.all_reduce(y)
        return y.view_as(h)
