"""Speculative decoding over the slot API: every slot drafts, ONE forward verifies them all, each slot keeps
what agrees, and everything else is rolled back exactly.

A step, for each slot holding n tokens and feeding its last emitted token x_n:
  1. draft     a drafter proposes d_1 .. d_k (k <= EngineOptions.speculative_tokens, fewer near max_seq_len):
               drafters.py;
  2. verify    one main-model forward over [x_n, d_1 .. d_k] for all slots together (ragged runs) gives the
               target logits: speculator.py;
  3. accept    the agreeing prefix plus one target token, exact for greedy and for sampling: acceptance.py;
  4. roll back token history, conv windows and recurrent states to the kept tokens: speculator.py.

The engine counts one main-model forward per step (`engine.forward_count`); draft forwards are not counted.
"""

from .acceptance import DRAW_ACCEPT, DRAW_DRAFT, DRAW_RESIDUAL, DRAW_TARGET, accept, reject_sample
from .drafters import Drafter, Drafts, MTPDrafter, Row, choose
from .speculator import SpecStats, Speculator, VerifyRun

__all__ = [
    "Speculator",
    "SpecStats",
    "VerifyRun",
    "Drafter",
    "Drafts",
    "MTPDrafter",
    "Row",
    "choose",
    "accept",
    "reject_sample",
    "DRAW_TARGET",
    "DRAW_DRAFT",
    "DRAW_ACCEPT",
    "DRAW_RESIDUAL",
]
