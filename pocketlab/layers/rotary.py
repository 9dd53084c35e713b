"""Rotary position embedding (HF's rotate-half convention), optionally on the first dims only."""
import torch


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
        cos, sin = self.cos[positions].unsqueeze(2), self.sin[positions].unsqueeze(2)
        rot, rest = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
        half = self.rotary_dim // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        out = rot * cos + rotated * sin
        return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out
