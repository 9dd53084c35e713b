"""Rotary position embedding (HF's rotate-half convention), optionally on the first dims only, and YaRN."""

import math

import torch

from .fused import compiled_in_graphs
from .norm import _rms_norm


class Rotary:
    def __init__(self, rotary_dim: int, theta: float, max_positions: int, device, dtype, yarn: dict | None = None):
        """yarn: the checkpoint's YaRN parameters (factor, original_max_position_embeddings, optional beta_fast,
        beta_slow, attention_factor, mscale, mscale_all_dim, truncate), or None for plain RoPE."""
        pos_freqs = theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim)
        inv_freq, scale = 1.0 / pos_freqs, 1.0
        if yarn is not None:
            inv_freq, scale = yarn_frequencies(pos_freqs, rotary_dim, theta, yarn)
        freqs = torch.outer(torch.arange(max_positions, device=device).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)

    def table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [B, T, 1, rotary_dim] for positions [B, T]: gathered once per forward, used by every layer."""
        return self.cos[positions].unsqueeze(2), self.sin[positions].unsqueeze(2)


def yarn_frequencies(pos_freqs: torch.Tensor, dim: int, theta: float, p: dict) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071) as HF transformers computes it: high-frequency dims keep their frequency
    (extrapolate), low-frequency dims are divided by `factor` (interpolate), a linear ramp between the two
    rotation counts beta_fast / beta_slow at the original context length; cos and sin are scaled by the
    attention factor 0.1 ln(factor) + 1 (or the mscale ratio)."""
    factor, original = p["factor"], p["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = p.get("attention_factor")
    if attention is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def dim_for(rotations: float) -> float:  # the dim whose wavelength fits `rotations` times in `original`
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_for(p.get("beta_fast") or 32), dim_for(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(pos_freqs.device)
    extrapolate = 1 - ramp  # 1: keep the original frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention)


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
