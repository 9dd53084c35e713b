"""What the engine's calls take and return: batch requests and forward results."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .sampling import GREEDY, SamplingParams


class Refusal(ValueError):
    """Bad input found inside a call before it changed any slot (e.g. a drafter's drafts): the slots stay as they
    were, where any other exception inside a call resets the slots it was working on (QwenEngine._transaction)."""


@dataclass
class ForwardResult:
    """One slot's outcome of a prefill or decode call."""

    next_token: int
    logits: torch.Tensor  # [vocab] float32, at the last position
    position: int  # tokens now cached in the slot
    reused_tokens: int = 0  # prompt tokens taken from the prefix cache instead of computed
    computed_tokens: int = 0  # prompt tokens run through the model (prefill: len(prompt) - reused_tokens)
    tokens: list[int] = field(default_factory=list)  # every token this call produced (speculative: 1 + accepted)

    def __post_init__(self):
        self.tokens = self.tokens or [self.next_token]


@dataclass
class BatchedRequest:
    """A request of the batch API: its prompt, its slot once allocated, and what it has generated."""

    request_id: int
    prompt_tokens: list[int]
    slot_id: int | None = None  # None: batch_prefill allocates one
    sampling: SamplingParams = GREEDY
    generated_tokens: list[int] = field(default_factory=list)

    @property
    def last_token(self) -> int | None:
        return self.generated_tokens[-1] if self.generated_tokens else None


@dataclass
class BatchPrefillResult:
    """One ForwardResult per request of a batch_prefill."""

    results: list[ForwardResult]

    @property
    def next_tokens(self) -> list[int]:
        return [r.next_token for r in self.results]


@dataclass
class BatchDecodeResult:
    """What one batch_decode_step produced, per request in call order."""

    next_tokens: list[int]  # the last token produced per request
    logits: torch.Tensor  # [B, vocab] float32, at the position that produced it
    positions: list[int]
    tokens: list[list[int]] = field(default_factory=list)  # all tokens produced per request (speculative: 1 + accepted)

    def __post_init__(self):
        self.tokens = self.tokens or [[t] for t in self.next_tokens]
