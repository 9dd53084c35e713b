"""What a one-row projection through the TMA ring (layers.gemv_tma) may compute over its input's heads as it reads
each tile, so the kernel before it needs no last program gathering a head's pieces (an arrival atomic and a second
pass over the row): the Gated DeltaNet's output norm (GatedHeadNorm, out_proj's input), or the merge of a split
decode attention's partial outputs (SplitMerge, o_proj's input). Handed to the projection as its `norm`; any other
launch runs it first, in torch or the given kernels (`__call__`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .invariant.elementwise import gated
from .invariant.norm import gated_weighted, rounding_dtypes
from .invariant.rounding import cast
from .norm import gated_rms_norm, norm_flavour

HEAD_GATED, SPLIT_MERGE = 3, 4  # the NORM constexprs after layers.norm's


class GatedHeadNorm:
    """w * norm(x) * silu(gate) over each head of x (the Gated DeltaNet's output norm), as invariant.gated_rms_norm
    and the state step's last program round it."""

    flavour, switch = HEAD_GATED, "POCKETLAB_RING_HEAD_NORM"

    def __init__(self, gate: torch.Tensor, weight: torch.Tensor, eps: float, kernels=None):
        self.gate, self.weight, self.eps = gate, weight, eps  # gate: x's shape, heads side by side in the last dim
        self.norm = kernels.gated_rms_norm if kernels is not None else gated_rms_norm

    @property
    def head_dim(self) -> int:
        return self.weight.shape[-1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        heads = (*x.shape[:-1], -1, self.head_dim)
        return self.norm(x.view(heads), self.gate.view(heads), self.weight, self.eps).view(x.shape)


class SplitMerge:
    """A decode attention's splits left unmerged (layers.decode_attention): partial outputs `parts` [B, H, S, D]
    and their log-sum-exps `lse` [B, H, S] in float32, weighted in split order, rounded, then times sigmoid(gate)
    ([B, H, D], Qwen3.5's output gate) where there is one, as the attention's own merge computes them."""

    flavour, switch = SPLIT_MERGE, "POCKETLAB_RING_ATTN_MERGE"

    def __init__(self, parts: torch.Tensor, lse: torch.Tensor, gate: torch.Tensor | None):
        self.parts, self.lse, self.gate = parts, lse, gate

    @property
    def head_dim(self) -> int:
        return self.parts.shape[-1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x's shape and dtype ([B, ..., H * D]): the merged heads (x itself unread)."""
        top = self.lse.amax(-1, keepdim=True)
        weights = torch.exp(self.lse - torch.where(top == float("-inf"), 0.0, top))
        total = weights.sum(-1, keepdim=True)
        merged = (weights / torch.where(total == 0, 1.0, total))[..., None].mul(self.parts).sum(-2).to(x.dtype)
        if self.gate is not None:
            merged = (merged.float() * torch.sigmoid(self.gate.float()).to(x.dtype).float()).to(x.dtype)
        return merged.reshape(x.shape)


def arguments(norm, y: torch.Tensor) -> tuple[tuple, dict]:
    """`x_tile`'s arguments for `norm` (None, a layers.norm.RMSNorm, or a prologue above; y stands in for every
    pointer left unread): (g, z, z's head stride, parts, lse, their head and split strides, splits, eps), the
    constexprs."""
    flavour = getattr(norm, "flavour", None)
    if flavour == SPLIT_MERGE:
        gate = y if norm.gate is None else norm.gate
        args = (y, gate, gate.stride(-2), norm.parts, norm.lse, *norm.parts.stride()[1:3], norm.lse.stride(1))
        args += (norm.parts.shape[2], 0.0)
        block_s = max(triton.next_power_of_2(norm.parts.shape[2]), 2)
        flavours = dict(NORM=SPLIT_MERGE, HEAD_D=norm.head_dim, BLOCK_S=block_s, GATED=norm.gate is not None)
        return args, flavours | rounding_dtypes(y.dtype, y.dtype)
    if flavour == HEAD_GATED:
        args = (norm.weight, norm.gate, norm.head_dim, y, y, 0, 0, 0, 0, norm.eps)
        dtypes = rounding_dtypes(y.dtype, norm.weight.dtype)
        return args, dict(NORM=HEAD_GATED, HEAD_D=norm.head_dim, BLOCK_S=2, GATED=False, **dtypes)
    args = (y if norm is None else norm.weight, y, 0, y, y, 0, 0, 0, 0, 0.0 if norm is None else norm.eps)
    flavours = dict(NORM=norm_flavour(norm), HEAD_D=1, BLOCK_S=2, GATED=False)
    return args, flavours | rounding_dtypes(y.dtype, y.dtype)


@triton.jit
def split_weights(lses):
    """Each split's weight in its row's merge from the splits' log-sum-exps [rows, splits] (-inf: no live key; a
    row without any weighs nothing): the decode attention's merge and SplitMerge's alike."""
    top = tl.max(lses, axis=1)
    top = tl.where(top == float("-inf"), 0.0, top)
    weights = tl.exp(lses - top[:, None])
    total = tl.sum(weights, axis=1)
    return weights / tl.where(total == 0, 1.0, total)[:, None]


@triton.jit
def x_tile(x_ptr, k, K, g_ptr, z_ptr, stride_zh, part_ptr, lse_ptr, stride_ph, stride_ps, stride_lh, S, eps,
           NORM: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_S: tl.constexpr, GATED: tl.constexpr,
           X_DTYPE: tl.constexpr, WX_DTYPE: tl.constexpr):  # fmt: skip
    """x's columns k (whole heads of HEAD_D where NORM > 2) in float32, and their squares: NORM 1 or 2 (layers.norm's
    flavours) times the norm's weight g; HEAD_GATED each head normed, weighted by g and gated by z; SPLIT_MERGE the
    S splits' partials merged, then gated by z where GATED (Qwen3.5's output gate), x itself unread."""
    if NORM == 4:  # SPLIT_MERGE
        head, d, live = k // HEAD_D, k % HEAD_D, k < K
        s = tl.arange(0, BLOCK_S)
        lses = tl.load(lse_ptr + head[:, None] * stride_lh + s[None, :], mask=live[:, None] & (s < S)[None, :],
                       other=float("-inf"))  # fmt: skip
        weights = split_weights(lses)
        merged = tl.zeros(k.shape, tl.float32)
        for t in tl.static_range(BLOCK_S):  # in split order, unrolled (no loop inside the ring's); past S, + 0
            w_t = tl.sum(tl.where(s[None, :] == t, weights, 0.0), axis=1)
            split = t + 0 * k  # per column: the interpreter cannot mask with scalar & tensor
            merged += w_t * tl.load(part_ptr + head * stride_ph + t * stride_ps + d, mask=live & (split < S), other=0.0)
        x = merged.to(X_DTYPE)
        if GATED:
            gate = tl.load(z_ptr + head * stride_zh + d, mask=live, other=0.0).to(tl.float32)
            x = gated(x.to(tl.float32), gate, X_DTYPE)
        x = x.to(tl.float32)
        return x, x * x
    x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
    squares = x * x
    if NORM == 3:  # HEAD_GATED
        BLOCK_K: tl.constexpr = x.shape[0]
        heads = tl.reshape(x, [BLOCK_K // HEAD_D, HEAD_D])
        inv_rms = tl.rsqrt(tl.sum(heads * heads, 1) / HEAD_D + eps)
        normed = tl.reshape(heads * inv_rms[:, None], [BLOCK_K])
        w = tl.load(g_ptr + k % HEAD_D).to(tl.float32)
        z = tl.load(z_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        x = cast(gated_weighted(normed, w, z, X_DTYPE, WX_DTYPE), X_DTYPE).to(tl.float32)
    elif NORM:
        x = x * (tl.load(g_ptr + k, mask=k < K, other=0.0).to(tl.float32) + (1.0 if NORM == 2 else 0.0))
    return x, squares
