"""ForwardContext: everything one model forward reads and hands back, besides the weights and the slot cache.

A forward runs B runs of new tokens, one per slot, padded on the right to T tokens. Padding tokens are routed
to the scratch slot so they never touch a live slot's KV or recurrent state; `lengths` says which are real.
The callers (engine, CUDA graphs, speculative decoding) fill the batch and the hooks; the model's `prepare`
step fills the tensors every layer shares; the layers read those and write the outputs.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from .layers.rotary import Rotary


class Run(NamedTuple):
    """One slot's new tokens in a forward, the first at position `start`."""

    slot: int
    start: int
    tokens: list[int]


class AttentionPath(str, enum.Enum):
    """How full-attention layers attend in this forward."""

    DECODE_KERNEL = "decode_kernel"  # one token per row: one kernel norms, rotates, stores K/V and attends
    MASKED = "masked"  # SDPA over each slot's cached keys under `mask`
    CAUSAL = "causal"  # one run with nothing cached before it: SDPA's causal flag, no mask (flash kernels)
    INVARIANT = "invariant"  # batch-invariant mode: one Triton kernel for every query, decode or prompt


@dataclass
class ForwardContext:
    """One forward's batch, its hooks, its outputs and the tensors its layers share (see the module doc)."""

    # the batch
    tokens: torch.Tensor  # [B, T] long, each run padded on the right
    slot_ids: torch.Tensor  # [B] long
    start: torch.Tensor  # [B] long, position of each run's first new token
    lengths: torch.Tensor  # [B] long, real new tokens per run (1..T)
    kv_len: int  # keys to attend over: max(start + lengths), or a captured graph's key bucket
    scratch_slot: int  # where padding tokens write
    padded: bool = True  # some run is shorter than T; False (known on the host): layers skip their padding masks

    # hooks, set by the caller
    checkpoints: Sequence[tuple[int, int]] = ()  # (row, offset): hand back each linear layer's state there
    gdn_log: dict[int, tuple] | None = None  # {} to collect, per Gated DeltaNet layer, what a rollback needs
    delta_rule: Callable | None = None  # runs instead of gated_delta_rule where Gated DeltaNet gathers states
    state_history: list[torch.Tensor] | None = None  # [] to collect per GDN layer the state after every token
    states_aside: bool = False  # GDN layers store the states they advance aside, not in the slots (cache.aside)

    # outputs, written by the layers
    checkpoint_states: dict[tuple[int, int], dict] = field(init=False)  # per request: {(kind, layer): state}

    # shared by every layer, filled by `prepare` at the start of each forward
    attention: AttentionPath | None = field(init=False, default=None)  # how full-attention layers attend
    positions: torch.Tensor | None = field(init=False, default=None)  # [B, T] absolute position per token
    rope: tuple[torch.Tensor, torch.Tensor] | None = field(init=False, default=None)  # (cos, sin) [B, T, 1, rot]
    rotary: Rotary | None = field(init=False, default=None)  # the model's rope tables (DECODE_KERNEL reads them)
    kv_targets: tuple[torch.Tensor, torch.Tensor] | None = field(init=False, default=None)  # K/V (slot, position)
    mask: torch.Tensor | None = field(init=False, default=None)  # [B, 1, T, kv_len], MASKED only
    kv_lengths: torch.Tensor | None = field(init=False, default=None)  # [B] keys per row after it, DECODE_KERNEL

    def __post_init__(self):
        self.checkpoint_states = {request: {} for request in self.checkpoints}

    @classmethod
    def build(
        cls, runs: list[Run], scratch_slot: int, device, checkpoints: Sequence[tuple[int, int]] = ()
    ) -> ForwardContext:
        """The batch tensors of `runs` on `device` (tokens padded with 0), hooks off but `checkpoints`."""
        if not runs or not all(run.tokens for run in runs):
            raise ValueError("a forward needs at least one run, and every run at least one token")
        T = max(len(run.tokens) for run in runs)
        tokens = torch.zeros(len(runs), T, dtype=torch.long)
        for b, run in enumerate(runs):
            tokens[b, : len(run.tokens)] = torch.tensor(run.tokens, dtype=torch.long)
        return cls(
            tokens=tokens.to(device, non_blocking=True),
            slot_ids=torch.tensor([run.slot for run in runs], device=device),
            start=torch.tensor([run.start for run in runs], device=device),
            lengths=torch.tensor([len(run.tokens) for run in runs], device=device),
            kv_len=max(run.start + len(run.tokens) for run in runs),
            scratch_slot=scratch_slot,
            padded=any(len(run.tokens) < T for run in runs),
            checkpoints=checkpoints,
        )

    def prepare(self, rotary: Rotary, decode_kernel: bool, invariant: bool = False) -> None:
        """Compute the tensors every layer shares, once per forward (again on every forward: a captured graph
        records this from its static inputs). rotary: the model's Rotary; decode_kernel: the model runs
        one-token rows through the decode-attention kernel, which writes K/V itself; invariant: every forward
        runs the batch-invariant attention kernel."""
        B, T = self.tokens.shape
        self.rope = self.kv_targets = self.mask = self.kv_lengths = None
        self.rotary = rotary
        if T == 1 and decode_kernel and not invariant:  # the kernel reads its rows of the rope tables itself
            self.attention = AttentionPath.DECODE_KERNEL
            self.positions, self.kv_lengths = self.start[:, None], self.start + 1
            return
        t = torch.arange(T, device=self.tokens.device)
        # padding repeats the last real position, so it stays in range
        self.positions = self.start[:, None] + torch.minimum(t[None, :], self.lengths[:, None] - 1)
        self.rope = rotary.table(self.positions)
        valid = t[None, :] < self.lengths[:, None]
        slots = torch.where(valid, self.slot_ids[:, None], self.scratch_slot)
        self.kv_targets = (slots, torch.where(valid, self.positions, t.expand_as(valid)))
        if invariant:
            self.attention = AttentionPath.INVARIANT
        elif B == 1 and self.kv_len == T:
            self.attention = AttentionPath.CAUSAL
        else:
            self.attention = AttentionPath.MASKED
            keys = torch.arange(self.kv_len, device=self.tokens.device)
            self.mask = keys[None, None, None, :] <= self.positions[:, None, :, None]
