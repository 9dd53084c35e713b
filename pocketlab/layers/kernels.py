"""The reductions and elementwise steps every layer calls, as one set chosen per engine: the default (cuBLAS,
torch; the fastest) or the batch-invariant Triton kernels (every row reduced in an order fixed by the weights'
shapes, never by the number of rows), so a request's logits do not depend on what else the batch holds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.nn.functional as F

from . import activations, norm


@dataclass(frozen=True)
class Kernels:
    linear: Callable = F.linear
    rms_norm: Callable = norm.rms_norm
    add_rms_norm: Callable = norm.add_rms_norm
    gated_rms_norm: Callable = norm.gated_rms_norm
    swiglu: Callable = activations.swiglu
    sigmoid_gate: Callable = activations.sigmoid_gate
    decay_and_beta: Callable = activations.decay_and_beta
    attention: Callable | None = None  # over the slot cache for every query; None: SDPA / the decode kernel
    norm_rotate_store: Callable | None = None  # q/k norms, RoPE and the K/V write before `attention`
    delta_rule_in_place: bool = False  # Gated DeltaNet: every token through the in-place kernels, no chunked rule


DEFAULT = Kernels()


def kernels_for(options) -> Kernels:
    if not options.batch_invariant:
        return DEFAULT
    from . import invariant
    from .invariant.attention import attention
    from .invariant.rotate import norm_rotate_store

    return Kernels(
        invariant.linear,
        invariant.rms_norm,
        invariant.add_rms_norm,
        invariant.gated_rms_norm,
        invariant.swiglu,
        invariant.sigmoid_gate,
        invariant.decay_and_beta,
        attention,
        norm_rotate_store,
        delta_rule_in_place=True,
    )
