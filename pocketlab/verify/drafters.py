"""Test drafters: drafts with a chosen acceptance, read from known continuations (verification tooling, not
the runtime)."""

from __future__ import annotations

from ..sampling import SamplingParams
from ..speculative import Drafter, Drafts


def _continuation(references, slot: int):
    """The reference sequence of `slot` ({slot: tokens} or a list by slot), or None."""
    if references is None:
        return None
    return (
        references.get(slot) if isinstance(references, dict) else (references[slot] if slot < len(references) else None)
    )


class OracleDrafter(Drafter):
    """Drafts read from known full sequences (prompt + greedy continuation), per slot: with the right
    reference every greedy draft is accepted, so steps measure the verify cost at full acceptance.
    references: {slot: tokens} or a list indexed by slot. accuracy < 1 makes each draft wrong (reference
    token + 1) unless a uniform drawn from (seed, sequence index) falls below it: a drafter with a chosen
    per-token acceptance rate, for sweeps and for exercising partial acceptance."""

    name = "oracle"

    def __init__(self, references, accuracy: float = 1.0, seed: int = 0):
        self.references, self.accuracy, self.seed = references, accuracy, seed

    def _right(self, index: int) -> bool:
        return self.accuracy >= 1 or (
            self.accuracy > 0 and SamplingParams(seed=self.seed).uniform(index, 7) < self.accuracy
        )

    def draft(self, spec, rows):
        V = spec.engine.cfg.vocab_size
        out = []
        for r in rows:
            seq = _continuation(self.references, r.slot) or []
            ref = seq[r.position + 1 : r.position + 1 + r.k]
            out.append([t if self._right(r.position + 1 + i) else (t + 1) % V for i, t in enumerate(ref)])
        return Drafts(out, [None] * len(rows))


class AdversarialDrafter(Drafter):
    """Drafts that are always wrong for greedy decoding: each reference token + 1 (mod vocab), or, with
    no reference, x_n + 1 + i. Every step then rejects at the first draft and rolls everything back."""

    name = "adversarial"

    def __init__(self, references=None):
        self.references = references

    def draft(self, spec, rows):
        V = spec.engine.cfg.vocab_size
        out = []
        for r in rows:
            seq = _continuation(self.references, r.slot)
            if seq is not None and len(seq) >= r.position + 1 + r.k:
                out.append([(t + 1) % V for t in seq[r.position + 1 : r.position + 1 + r.k]])
            else:
                out.append([(r.token + 1 + i) % V for i in range(r.k)])
        return Drafts(out, [None] * len(rows))
