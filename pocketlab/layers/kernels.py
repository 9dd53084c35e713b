"""The reductions and elementwise steps every layer calls, as one set chosen per engine: the default (the fastest:
cuBLAS and torch, and on CUDA our Triton kernels for decode-sized projections and every row-wise step) or the
batch-invariant Triton kernels (every row reduced in an order fixed by the weights' shapes, never by the number of
rows), so a request's logits do not depend on what else the batch holds."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import activations, greedy, matmul_tma, moe, norm
from .linear import fused_at_few_rows, streams_as_gemv
from .linear import linear as composed_linear


@dataclass(frozen=True)
class Kernels:
    linear: Callable = composed_linear  # (x, weight, bias=None, *, residual=None, swiglu=False, norm=None)
    rms_norm: Callable = norm.rms_norm
    gated_rms_norm: Callable = norm.gated_rms_norm
    sigmoid_gate: Callable = activations.sigmoid_gate
    decay_and_beta: Callable = activations.decay_and_beta
    attention: Callable | None = None  # over the slot cache for every query; None: SDPA / the decode kernel
    norm_rotate_store: Callable | None = None  # q/k norms, RoPE and the K/V write before `attention`
    delta_rule_in_place: bool = False  # Gated DeltaNet: every token through the in-place kernels, no chunked rule
    moe_route: Callable = moe.route  # (router logits, top_k, renormalize) -> (weights, expert ids)
    moe_experts: Callable = moe.grouped_experts  # (x, gate_up, down, weights, ids, residual, shared, shared_gate)
    moe_few_experts: Callable | None = None  # the same and norm=, for up to moe_few_tokens tokens (layers.moe_gemv)
    moe_few_tokens: int = 0
    # tensor parallelism (pocketlab.parallel): the sum over ranks of row-parallel outputs (None: one device), the
    # vocab-parallel embedding lookup, and the gather of vocab-parallel logits
    all_reduce: Callable | None = None
    embedding: Callable = F.embedding
    gather_vocab: Callable = lambda logits: logits  # noqa: E731
    logits_and_argmax: Callable = greedy.torch_logits_and_argmax  # a decode graph's float32 logits and greedy tokens
    folds_norm: Callable = lambda weight, swiglu=False: False  # noqa: E731  # a pre-norm's weight into its projection

    def project_out(self, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + x @ weight.T, for o_proj, down_proj, out_proj: the residual stream. Split over ranks each
        holds some input columns: one all-reduce sums the parts, then the residual is added once."""
        if self.all_reduce is not None:
            return residual + self.all_reduce(self.linear(x, weight))
        return self.linear(x, weight, residual=residual)


DEFAULT = Kernels()


def _triton_on_cuda(options) -> bool:
    return torch.device(options.device).type == "cuda" and importlib.util.find_spec("triton") is not None


def fuses_linear(options) -> bool:
    """Whether the default kernels run few-row projections through the fused Triton kernel (matmul and residual
    add or SwiGLU in one launch) and the norms and gates through their Triton row kernels: options.fused_linear,
    "auto" meaning on CUDA with Triton. Then no decode graph holds a torch.compile graph, which dynamo would trace
    again in every new process before its first decode step, disk cache or not."""
    if options.fused_linear == "auto":
        return _triton_on_cuda(options)
    return options.fused_linear == "triton"


def moe_in_triton(options) -> bool:
    """Whether the routed experts run layers.moe_kernel's Triton kernels: options.moe_kernel, "auto" meaning on
    CUDA with Triton, and always with batch-invariant kernels (grouped_mm's per-row order is not fixed)."""
    if options.batch_invariant or options.moe_kernel == "triton":
        return True
    return options.moe_kernel == "auto" and _triton_on_cuda(options)


def kernels_for(options) -> Kernels:
    kernels = dataclasses.replace(_kernels_for(options), **_moe_kernels(options))
    if options.tensor_parallel == 1:
        return kernels
    from ..parallel import comm

    return dataclasses.replace(
        kernels, all_reduce=comm.all_reduce, embedding=comm.vocab_embedding, gather_vocab=comm.gather_last
    )


def folds_norm(options, weight: torch.Tensor, swiglu: bool = False) -> bool:
    """options.fold_norm_weights for a projection that reads a pre-norm (qkv, in_proj, gate_up): "auto" wherever
    few-row calls take the TMA ring, whose residual epilogue leaves each row's sum of squares for the next
    projection's norm (batches of 2-64 rows then launch no norm), and for a gate_up (`swiglu`) whose one-row call
    would otherwise run the norm as a launch of its own before the fused matmul (no GEMV takes it: past its weight
    limit, or gemv_rows 0)."""
    if options.fold_norm_weights == "auto":
        few_rows_ring = matmul_tma.ring_for(matmul_tma.MAX_ROWS, torch.device(options.device)) is not None
        return few_rows_ring or (swiglu and not (options.gemv_rows and streams_as_gemv(weight)))
    return options.fold_norm_weights == "always"


def _moe_kernels(options) -> dict:
    """The routing kernel runs on CUDA only. It takes the lowest of equal experts first, as torch.topk does on CUDA
    where a whole row ties (a zero router); torch.topk on the CPU, HF's float32 reference, orders ties its own way."""
    if not moe_in_triton(options):
        return dict(moe_route=moe.route, moe_experts=moe.grouped_experts)
    from .moe_kernel import fused_experts, route_in_one_launch

    on_cuda = torch.device(options.device).type == "cuda"
    kernels = dict(moe_route=route_in_one_launch if on_cuda else moe.route, moe_experts=fused_experts)
    if options.batch_invariant or not fuses_linear(options) or not options.moe_gemv_tokens:
        return kernels
    from . import moe_gemv_tma  # decode's token streams its experts' rows as the linears do (layers.moe_gemv)

    return kernels | dict(moe_few_experts=moe_gemv_tma.few_experts, moe_few_tokens=options.moe_gemv_tokens)


def _kernels_for(options) -> Kernels:
    if not (options.batch_invariant or fuses_linear(options)):
        return DEFAULT
    from . import invariant
    from .invariant.rotate import norm_rotate_store

    rows = (invariant.rms_norm, invariant.gated_rms_norm, invariant.sigmoid_gate, invariant.decay_and_beta)
    if not options.batch_invariant:  # rows never mix in these, so the row kernels cost no speed: only the matmul
        from .gemv import gemv

        linear = fused_at_few_rows(invariant.linear, gemv, options.gemv_rows)  # stays cuBLAS beyond decode's rows
        return Kernels(  # norm_rotate_store: a prompt's q/k norms, RoPE and K/V write
            linear,
            *rows,
            norm_rotate_store=norm_rotate_store,
            logits_and_argmax=greedy.logits_and_argmax,
            folds_norm=functools.partial(folds_norm, options),
        )
    from .invariant.attention import attention

    return Kernels(
        invariant.linear, *rows, attention, norm_rotate_store, delta_rule_in_place=True,
        logits_and_argmax=greedy.logits_and_argmax,
    )  # fmt: skip
