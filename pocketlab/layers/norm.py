"""RMSNorm in the two flavours Qwen uses: `w * x` (Qwen2/3) and `(1 + w) * x` (Qwen3.5)."""

import torch

from .fused import compiled_in_graphs


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    """Normalise in float32 like HF does, so low-precision runs round the same way."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if offset:  # Qwen3.5 stores w with the 1 taken out
        return (xf * (1.0 + weight.float())).to(x.dtype)
    return weight * xf.to(x.dtype)


rms_norm = compiled_in_graphs(_rms_norm)


@compiled_in_graphs
def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated DeltaNet output norm: w * norm(x) * silu(gate), computed in float32."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf.to(x.dtype) * torch.nn.functional.silu(gate.float())).to(x.dtype)


NO_NORM, NORM, NORM_OFFSET = 0, 1, 2  # a norm folded into a launch: none, `g * x` (Qwen2/3), `(1 + g) * x` (Qwen3.5)


def norm_flavour(norm) -> int:
    """The NORM constexpr of the kernels that fold an optional RMSNorm into their launch (layers.gemv and its kin)."""
    return NO_NORM if norm is None else NORM_OFFSET if norm.offset else NORM


class RMSNorm:
    """A pre-norm: its weight, eps and flavour, applied by `kernels.rms_norm` (None: the torch one) when called.
    Handed to the projection that reads it (`linear(h, w, norm=...)`), which may instead norm each row itself."""

    def __init__(self, weight: torch.Tensor, eps: float, offset: bool = False, kernels=None):
        self.weight, self.eps, self.offset = weight, eps, offset
        self.unit = False  # True once fold_into moved the weight into the projection: the norm is x * rsqrt alone
        self.norm = kernels.rms_norm if kernels is not None else rms_norm

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h, self.weight, self.eps, self.offset)

    def fold_into(self, weight: torch.Tensor) -> torch.Tensor:
        """Multiply this norm's per-column scale into `weight` [N, K] (in place, float32, rounded once) and leave the
        norm a unit one: x @ (W g)^T = (g * x) @ W^T, so the projection may apply the norm as one scalar per row
        (layers.invariant.matmul), with no norm launch of its own."""
        scale = self.weight.float() + 1.0 if self.offset else self.weight.float()
        for rows in weight.split(4096):  # a float32 copy of a slice at a time, not of the whole weight
            rows.copy_(rows.float() * scale)
        self.weight, self.offset, self.unit = torch.ones_like(self.weight), False, True
        return weight
