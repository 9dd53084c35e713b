"""Rotary position embedding (HF's rotate-half convention), optionally on the first dims only."""
import torch

from .fused import cuda_compiled


class Rotary:
    def __init__(self, rotary_dim: int, theta: float, max_positions: int, device, dtype):
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float()
                                    / rotary_dim))
        freqs = torch.outer(torch.arange(max_positions, device=device).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos().to(dtype), emb.sin().to(dtype)
        self.rotary_dim = rotary_dim

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [B, T, heads, head_dim]; positions: [B, T]."""
        return apply_rotary(x, self.cos[positions].unsqueeze(2), self.sin[positions].unsqueeze(2))


@cuda_compiled
def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rotary_dim = cos.shape[-1]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    out = rot * cos + torch.cat((-rot[..., half:], rot[..., :half]), dim=-1) * sin
    return torch.cat((out, rest), dim=-1)
