"""Per-request sampling: greedy, temperature, top-k, top-p, HF's repetition penalty, reproducible from a seed.

Each draw takes its uniform number from (seed, position) alone, so a request samples the same tokens
whatever batch it runs in, and a restored snapshot continues exactly as the original would.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means no top-k cut
    top_p: float = 1.0
    seed: int = 0
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    repetition_penalty: float = 1.0  # transformers': logits of tokens already in the sequence / p (> 0) or * p

    def __post_init__(self):
        bad_penalty = not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty))
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1 or self.max_new_tokens < 0 or bad_penalty:
            raise ValueError(
                f"invalid sampling parameters {self}: need temperature >= 0, top_k >= 0, "
                "0 < top_p <= 1, max_new_tokens >= 0, a finite repetition_penalty > 0"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def uniform(self, position: int, draw: int = 0) -> float:
        """The uniform number used for the token at `position` (`draw` indexes extra draws per position)."""
        return random.Random(f"{self.seed}:{position}:{draw}").random()


GREEDY = SamplingParams()


def penalize(
    logits: torch.Tensor, params: list[SamplingParams], history: Callable[[int], Sequence[int]]
) -> torch.Tensor:
    """transformers' RepetitionPenaltyLogitsProcessor, before any other step (greedy included): in each row whose
    penalty is not 1, the logits of the tokens its sequence already holds (prompt and output) are divided by the
    penalty where positive, multiplied where negative. history(b) -> row b's sequence so far, asked only for
    penalized rows. logits [B, V] are returned as they are when no row is penalized, else a penalized copy."""
    rows = [b for b, p in enumerate(params) if p.repetition_penalty != 1.0]
    if not rows:
        return logits
    out = logits.clone()
    for b in rows:
        seen = torch.tensor(sorted(set(history(b))), dtype=torch.long, device=logits.device)
        penalty, scores = params[b].repetition_penalty, out[b, seen]
        out[b, seen] = torch.where(scores < 0, scores * penalty, scores / penalty)
    return out


def sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> torch.Tensor:
    """logits [B, V] (float32, penalized already) -> tokens [B]; one params and one sequence position per row."""
    greedy = logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        return greedy
    probs = filtered_probs(logits, params)
    u = torch.tensor([p.uniform(pos) for p, pos in zip(params, positions, strict=True)], device=logits.device)
    drawn = inverse_cdf(probs, u)
    is_greedy = torch.tensor([p.greedy for p in params], device=logits.device)
    return torch.where(is_greedy, greedy, drawn)


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Softmax(logits / T) restricted to each row's top-k and top-p set, renormalised. [B, V]."""
    dev = logits.device
    temp = torch.tensor([max(p.temperature, 1e-5) for p in params], device=dev)[:, None]
    top_k = torch.tensor([p.top_k or logits.shape[-1] for p in params], device=dev)[:, None]
    top_p = torch.tensor([p.top_p for p in params], device=dev)[:, None]
    sorted_logits, order = (logits.float() / temp).sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    rank = torch.arange(logits.shape[-1], device=dev)[None, :]
    keep = (rank < top_k) & ((probs.cumsum(-1) - probs) < top_p)  # mass before a token < p: keep it
    probs = probs * keep
    probs = probs / probs.sum(-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(-1, order, probs)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Draw one token per row from probs [B, V] with uniforms u [B]."""
    cdf = probs.cumsum(dim=-1)
    target = (u.clamp_min(1e-9) * cdf[:, -1])[:, None].contiguous()  # u=0 must not pick a zero-mass token
    idx = torch.searchsorted(cdf, target).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1)
