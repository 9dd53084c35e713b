"""Rotary position embedding (HF's rotate-half convention), optionally on the first dims only."""

import torch

from .fused import compiled_in_graphs
from .norm import _rms_norm


class Rotary:
    def __init__(self, rotary_dim: int, theta: float, max_positions: int, device, dtype):
        inv_freq = 1.0 / (
            theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim)
        )
        freqs = torch.outer(torch.arange(max_positions, device=device).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos().to(dtype), emb.sin().to(dtype)

    def table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [B, T, 1, rotary_dim] for positions [B, T]: gathered once per forward, used by every layer."""
        return self.cos[positions].unsqueeze(2), self.sin[positions].unsqueeze(2)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rotary_dim = cos.shape[-1]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    out = rot * cos + torch.cat((-rot[..., half:], rot[..., :half]), dim=-1) * sin
    return torch.cat((out, rest), dim=-1)


@compiled_in_graphs
def norm_and_rotate(
    q: torch.Tensor, k: torch.Tensor, q_norm, k_norm, cos: torch.Tensor, sin: torch.Tensor, eps: float, offset: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head q/k RMSNorm (Qwen3, Qwen3.5; None for Qwen2) then RoPE, as one kernel on CUDA."""
    if q_norm is not None:
        q, k = _rms_norm(q, q_norm, eps, offset), _rms_norm(k, k_norm, eps, offset)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
