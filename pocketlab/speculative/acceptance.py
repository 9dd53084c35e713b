"""Which drafts a slot keeps, and the token drawn after them.

Greedy rows keep the longest prefix of drafts equal to the target's argmax, plus the target's own next token.
Sampling rows run speculative rejection sampling: draft d is accepted with probability min(1, p(d) / q(d)),
else the token is drawn from norm(max(0, p - q)), and a bonus token is drawn from p after every draft is
accepted; so every emitted token has exactly plain sampling's distribution.

Uniform numbers come from SamplingParams.uniform(index, draw), index being the sequence index of the token
being decided and draw one of the DRAW_* kinds below, so results do not depend on the batch a slot runs in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..sampling import filtered_probs, inverse_cdf

if TYPE_CHECKING:
    from .drafters import Drafts, Row

DRAW_TARGET = 0  # a token drawn straight from the target (the bonus token; also what plain decoding uses)
DRAW_DRAFT = 1  # a draft drawn from the drafter's q
DRAW_ACCEPT = 2  # the acceptance test of a draft
DRAW_RESIDUAL = 3  # the draw from the residual max(0, p - q) after a rejection


def accept(logits: torch.Tensor, rows: list[Row], drafts: Drafts) -> tuple[list[list[int]], list[int]]:
    """Target logits [B, T, V] of the fed runs [x_n, d_1 .. d_k] -> (emitted tokens, kept count) per row."""
    greedy = logits.argmax(-1).tolist()
    emitted, kept = [], []
    samp = [b for b, r in enumerate(rows) if not r.sampling.greedy]
    p_all = None
    if samp:
        T, V = logits.shape[1], logits.shape[2]
        params = [rows[b].sampling for b in samp for _ in range(T)]
        p_all = filtered_probs(logits[samp].reshape(-1, V), params).view(len(samp), T, V)
    for b, (r, d) in enumerate(zip(rows, drafts.tokens, strict=True)):
        if r.sampling.greedy:
            a = 0
            while a < len(d) and d[a] == greedy[b][a]:
                a += 1
            emitted.append(greedy[b][: a + 1])
        else:
            assert p_all is not None  # a sampling row: set above
            a, tok = reject_sample(p_all[samp.index(b)], d, drafts.probs[b], r)
            emitted.append(d[:a] + [tok])
        kept.append(a + 1)
    return emitted, kept


def reject_sample(p: torch.Tensor, d: list[int], q: torch.Tensor | None, r: Row) -> tuple[int, int]:
    """Speculative rejection sampling for one row: p [T, V] target, q [k, V] draft (None: fixed drafts,
    i.e. q one-hot). Returns (accepted drafts, the token drawn after them)."""
    sp, k = r.sampling, len(d)
    if k:
        ar = torch.arange(k, device=p.device)
        dt = torch.tensor(d, device=p.device)
        pd = p[ar, dt].tolist()
        qd = q[ar, dt].tolist() if q is not None else [1.0] * k
        for i in range(k):
            index = r.position + 1 + i
            if qd[i] > 0 and sp.uniform(index, DRAW_ACCEPT) < pd[i] / qd[i]:
                continue
            if q is not None:
                resid = (p[i] - q[i]).clamp_min(0)
            else:
                resid = p[i].clone()
                resid[d[i]] = 0
            if float(resid.sum()) <= 0:  # p == q up to rounding: any draw from p is right
                resid = p[i]
            u = torch.tensor([sp.uniform(index, DRAW_RESIDUAL)], device=p.device)
            return i, int(inverse_cdf(resid[None], u)[0])
    u = torch.tensor([sp.uniform(r.position + 1 + k, DRAW_TARGET)], device=p.device)
    return k, int(inverse_cdf(p[k][None], u)[0])
