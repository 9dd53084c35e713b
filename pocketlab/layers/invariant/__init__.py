"""Batch-invariant kernels: a row's result is bitwise the same whatever other rows share the call.

Every reduction a row takes part in runs in an order fixed by the weight's or row's shape, never by the
number of rows, so batch size, padding buckets, prefill chunking and multi-token verify steps cannot change a
request's logits. Needs Triton (a GPU, or TRITON_INTERPRET=1 on the CPU).
"""

from .elementwise import decay_and_beta, sigmoid_gate, swiglu
from .matmul import Order, Tiles, linear, order, tiles
from .norm import gated_rms_norm, rms_norm

__all__ = [
    "attention",
    "decay_and_beta",
    "sigmoid_gate",
    "swiglu",
    "Order",
    "Tiles",
    "order",
    "tiles",
    "gated_rms_norm",
    "linear",
    "rms_norm",
]
