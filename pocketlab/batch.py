"""ForwardBatch: one model forward over B sequences, each a run of new tokens for one slot.

Sequences are padded on the right to T tokens. Padding tokens are routed to the scratch slot so they
never touch a live slot's KV or recurrent state; `lengths` says which tokens are real.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ForwardBatch:
    tokens: torch.Tensor  # [B, T] long
    slot_ids: torch.Tensor  # [B] long
    start: torch.Tensor  # [B] long, position of each sequence's first new token
    lengths: torch.Tensor  # [B] long, real new tokens per sequence (1..T)
    kv_len: int  # keys to attend over: max(start + lengths), or the static cache length
    scratch_slot: int
    # (row, t) -> {} that stateful layers fill with their state after the row's first t new tokens
    checkpoints: dict[tuple[int, int], dict] = field(default_factory=dict)

    @classmethod
    def build(cls, seqs: list[tuple[int, int, list[int]]], scratch_slot: int, device) -> ForwardBatch:
        """seqs: (slot_id, start_position, new_tokens) per sequence."""
        T = max(len(toks) for _, _, toks in seqs)
        tokens = torch.zeros(len(seqs), T, dtype=torch.long)
        for b, (_, _, toks) in enumerate(seqs):
            tokens[b, : len(toks)] = torch.tensor(toks, dtype=torch.long)
        return cls(
            tokens=tokens.to(device, non_blocking=True),
            slot_ids=torch.tensor([s for s, _, _ in seqs], device=device),
            start=torch.tensor([p for _, p, _ in seqs], device=device),
            lengths=torch.tensor([len(t) for _, _, t in seqs], device=device),
            kv_len=max(p + len(t) for _, p, t in seqs),
            scratch_slot=scratch_slot,
        )

    @property
    def causal_only(self) -> bool:
        """One sequence, nothing cached before it: plain causal attention (flash kernels) suffices."""
        return self.tokens.shape[0] == 1 and self.kv_len == self.tokens.shape[1]

    @property
    def positions(self) -> torch.Tensor:
        """[B, T] absolute position of every token; padding repeats the last real one (stays in range)."""
        t = torch.arange(self.tokens.shape[1], device=self.tokens.device)
        return self.start[:, None] + torch.minimum(t[None, :], self.lengths[:, None] - 1)

    @property
    def valid(self) -> torch.Tensor:
        """[B, T] True for real tokens."""
        return torch.arange(self.tokens.shape[1], device=self.tokens.device) < self.lengths[:, None]

    def write_targets(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot, position) [B, T] where each token's K/V goes: its own slot, or the scratch slot for padding."""
        valid = self.valid
        slots = torch.where(valid, self.slot_ids[:, None], self.scratch_slot)
        t = torch.arange(self.tokens.shape[1], device=self.tokens.device).expand_as(valid)
        return slots, torch.where(valid, positions, t)

    def attention_mask(self, positions: torch.Tensor) -> torch.Tensor:
        """[B, 1, T, kv_len] causal mask over each slot's cached keys plus the new ones."""
        keys = torch.arange(self.kv_len, device=self.tokens.device)
        return keys[None, None, None, :] <= positions[:, None, :, None]
