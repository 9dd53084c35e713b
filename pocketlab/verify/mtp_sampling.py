"""Sampling stays exact under speculation: a chi-square test of speculative samples against the exact joint law
of plain sampling."""

from __future__ import annotations

import contextlib

import pandas as pd
import torch

from ..engine import QwenEngine
from ..requests import BatchedRequest
from ..sampling import SamplingParams, filtered_probs
from .common import random_prompts, single_thread_on_cpu
from .mtp_runs import DEFAULT_MODEL, mtp_engine, plain, plain_greedy, use_drafter


def exact_joint(eng: QwenEngine, prompt: list[int], sp: SamplingParams, depth: int) -> dict[tuple, float]:
    """P(first `depth` generated tokens) under plain sampling, by enumerating every path (top_k keeps it small)."""
    out = {}

    def walk(path, prob):
        if len(path) == depth:
            out[tuple(path)] = prob
            return
        r = eng.prefill(prompt + path, slot_id=0)
        p = filtered_probs(r.logits[None].float(), [sp])[0]
        for t in torch.nonzero(p > 0).flatten().tolist():
            walk(path + [t], prob * float(p[t]))

    with plain(eng), torch.inference_mode():
        walk([], 1.0)
    eng.reset()
    return out


def chi_square(counts: dict[tuple, int], probs: dict[tuple, float], min_expected: float = 5.0) -> dict:
    """Goodness of fit of counts to probs; categories expected below min_expected are pooled into one."""
    n = sum(counts.values())
    extra = set(counts) - set(probs)
    if extra:  # a sample the law gives probability 0: impossible under the null
        return dict(n=n, categories=len(probs), dof=0, chi2=float("inf"), p_value=0.0, impossible=len(extra))
    big = [c for c in probs if probs[c] * n >= min_expected]
    small = [c for c in probs if probs[c] * n < min_expected]
    obs = [counts.get(c, 0) for c in big]
    exp = [probs[c] * n for c in big]
    if small:
        obs.append(sum(counts.get(c, 0) for c in small))
        exp.append(sum(probs[c] for c in small) * n)
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True) if e > 0)
    dof = len(obs) - 1
    p = (
        float(
            torch.special.gammaincc(
                torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)
            )
        )
        if dof > 0
        else 1.0
    )
    return dict(n=n, categories=len(obs), dof=dof, chi2=stat, p_value=p, impossible=0)


@single_thread_on_cpu
def sampling_check(
    model=DEFAULT_MODEL,
    device: str = "cpu",
    dtype: str = "float32",
    seed: int = 0,
    drafters=("plain", "mtp", "oracle", "adversarial"),
    k: int = 2,
    runs: int = 600,
    temperature: float = 1.0,
    top_k: int = 3,
    depth: int = 3,
    prompt_len: int = 6,
    alpha: float = 1e-3,
    slots: int = 8,
    wrong_temperature: float = 0.5,
) -> pd.DataFrame:
    """For each drafter, `runs` sampled continuations (seeds disjoint from every other drafter's) of one prompt,
    and a chi-square test of their first `depth` tokens against the exact joint law of plain sampling
    (significance level `alpha`: a drafter passes when p_value >= alpha). "plain" is speculation off, the
    check on the check; the "wrong law" row tests the pooled speculative samples against the law at
    temperature * `wrong_temperature`, which must be rejected (the test has power). Oracle drafts follow the
    greedy continuation (right only while the sample does), adversarial ones are never in the top-k."""
    make, vocab = mtp_engine(model, device, dtype, seed)
    prompt = random_prompts(vocab, [prompt_len], seed)[0]
    eng = make(speculative_tokens=k, max_slots=slots, max_seq_len=prompt_len + depth + k + 8, prefill_chunk=16)
    base = SamplingParams(temperature=temperature, top_k=top_k)
    law = exact_joint(eng, prompt, base, depth)
    wrong = exact_joint(eng, prompt, SamplingParams(temperature=temperature * wrong_temperature, top_k=top_k), depth)
    greedy = plain_greedy(eng, [prompt], depth + k)[0]
    refs = {j: greedy for j in range(slots)}
    pooled: dict[tuple, int]
    rows, pooled = [], {}
    for d_i, name in enumerate(drafters):
        ctx = plain(eng) if name == "plain" else contextlib.nullcontext()
        if name != "plain":
            use_drafter(eng, name, refs)
            eng.speculator.stats = type(eng.speculator.stats)()
        counts: dict[tuple, int] = {}
        with ctx:
            for b0 in range(0, runs, slots):
                n = min(slots, runs - b0)
                sps = [
                    SamplingParams(temperature=temperature, top_k=top_k, seed=seed * 1_000_003 + d_i * runs + b0 + j)
                    for j in range(n)
                ]
                reqs = [BatchedRequest(j, list(prompt), slot_id=j, sampling=sp) for j, sp in enumerate(sps)]
                eng.batch_prefill(reqs)
                while min(len(r.generated_tokens) for r in reqs) < depth:
                    eng.batch_decode_step([r for r in reqs if len(r.generated_tokens) < depth])
                for r in reqs:
                    key = tuple(r.generated_tokens[:depth])
                    counts[key] = counts.get(key, 0) + 1
        st = None if name == "plain" else eng.speculator.stats
        res = chi_square(counts, law)
        rows.append(
            dict(
                drafter=name,
                k=0 if name == "plain" else k,
                law="plain sampling",
                **res,
                acceptance_rate=st.acceptance_rate if st else float("nan"),
                drafted=st.drafted if st else 0,
                accepted=st.accepted if st else 0,
                **{"pass": res["p_value"] >= alpha},
            )
        )
        if name != "plain":
            for c, v in counts.items():
                pooled[c] = pooled.get(c, 0) + v
    res = chi_square(pooled, wrong)
    rows.append(
        dict(
            drafter="all speculative",
            k=k,
            law=f"WRONG: temperature x{wrong_temperature:g}",
            **res,
            acceptance_rate=float("nan"),
            drafted=0,
            accepted=0,
            **{"pass": res["p_value"] < alpha},
        )
    )
    return pd.DataFrame(rows)
