"""MTP speculative decoding is exact: greedy token-identical, sampling distribution-identical (notebook 06).

    greedy_equality(...)   every drafter x k: batched, interleaved slots give plain greedy decoding's tokens
    acceptance_sweep(...)  tokens per step against the per-draft acceptance rate, measured vs (1-a^(k+1))/(1-a)
    sampling_check(...)    chi-square of speculative samples against the exact joint law (verify.mtp_sampling)
    mtp_speculative(...)   the three as one Report
The cost on a device: verify.mtp_cost.verify_cost. The runs they share: verify.mtp_runs.
"""

from __future__ import annotations

import pandas as pd

from ..config import ModelConfig
from ..tools.synthetic import PRESETS
from .common import Report, random_prompts, single_thread_on_cpu
from .mtp_cost import expected_tokens_per_step
from .mtp_runs import DEFAULT_MODEL, DRAFTERS, interleaved, mtp_engine, plain_greedy, use_drafter
from .mtp_sampling import sampling_check


# -- checks --------------------------------------------------------------------------------------
@single_thread_on_cpu
def greedy_equality(
    model=DEFAULT_MODEL,
    device: str = "cpu",
    dtype: str = "float32",
    seed: int = 0,
    ks=(1, 2, 3),
    drafters=DRAFTERS,
    prompt_lens=(5, 9, 14),
    new_tokens: int = 64,
    prefill_chunk: int = 8,
    rollback: str = "states",
    **options,
) -> pd.DataFrame:
    """One row per (drafter, k): do all slots' tokens equal plain greedy decoding's? Plus acceptance figures
    and whether every batch call ran exactly one model forward. options: more EngineOptions for every engine."""
    make, vocab = mtp_engine(model, device, dtype, seed, **options)
    prompts = random_prompts(vocab, prompt_lens, seed)
    seq_len = max(prompt_lens) + new_tokens + max(ks) + 8
    opts = dict(max_slots=len(prompts), max_seq_len=seq_len, prefill_chunk=prefill_chunk, speculative_rollback=rollback)
    eng = make(speculative_tokens=max(ks), **opts)
    refs = plain_greedy(eng, prompts, new_tokens + max(ks))
    rows = []
    for name in drafters:
        for k in ks:
            eng = make(speculative_tokens=k, **opts)
            use_drafter(eng, name, dict(enumerate(refs)))
            reqs, calls = interleaved(eng, prompts, new_tokens)
            firsts = []
            for r, ref in zip(reqs, refs, strict=True):
                got, want = r.generated_tokens[: new_tokens + 1], ref[len(r.prompt_tokens) :][: new_tokens + 1]
                firsts.append(next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), -1))
            st = eng.speculator.stats
            decodes = [c for c in calls if "decode" in c["call"]]
            rows.append(
                dict(
                    drafter=name,
                    k=k,
                    slots=len(reqs),
                    tokens=new_tokens + 1,
                    tokens_equal=all(f < 0 for f in firsts),
                    first_divergence=max(firsts),
                    decode_calls=len(decodes),
                    one_forward_per_call=all(c["forwards"] == 1 for c in decodes),
                    acceptance_rate=st.acceptance_rate,
                    tokens_per_step=st.tokens_per_step,
                )
            )
    df = pd.DataFrame(rows)
    df["pass"] = df.tokens_equal & df.one_forward_per_call
    return df


@single_thread_on_cpu
def acceptance_sweep(
    model=DEFAULT_MODEL,
    device: str = "cpu",
    dtype: str = "float32",
    seed: int = 0,
    ks=(1, 2, 3),
    accuracies=(0.0, 0.25, 0.5, 0.75, 0.9, 1.0),
    prompt_len: int = 8,
    new_tokens: int = 48,
) -> pd.DataFrame:
    """Oracle drafts made wrong at random with a chosen rate: tokens per step against the theory
    (1 - a^(k+1)) / (1 - a), and output still equal to plain greedy decoding."""
    make, vocab = mtp_engine(model, device, dtype, seed)
    prompt = random_prompts(vocab, [prompt_len], seed)[0]
    opts = dict(max_slots=1, max_seq_len=prompt_len + new_tokens + max(ks) + 8, prefill_chunk=16)
    eng = make(speculative_tokens=max(ks), **opts)
    ref = plain_greedy(eng, [prompt], new_tokens + max(ks))[0]
    rows = []
    for k in ks:
        eng = make(speculative_tokens=k, **opts)
        for a in accuracies:
            eng.reset()
            use_drafter(eng, f"oracle@{a}", {0: ref})
            eng.speculator.stats = type(eng.speculator.stats)()
            r = eng.prefill(prompt)
            out = [r.next_token]
            while len(out) < new_tokens + 1:
                out.extend(eng.decode_step(out[-1]).tokens)
            st = eng.speculator.stats
            rows.append(
                dict(
                    k=k,
                    draft_accuracy=a,
                    acceptance_rate=st.acceptance_rate,
                    tokens_per_step=st.tokens_per_step,
                    theory=expected_tokens_per_step(a, k),
                    steps=st.steps,
                    tokens_equal=out[: new_tokens + 1] == ref[prompt_len:][: new_tokens + 1],
                )
            )
    return pd.DataFrame(rows)


def checked_model(model) -> tuple[str, str]:
    """(model whose exactness is checked, note). Exactness needs an MTP head and float32-exact greedy tokens:
    a model without a head, or a real-shape preset (random weights), is checked on the tiny MTP preset."""
    name = str(model)
    if name in PRESETS:
        if name.startswith("tiny") and PRESETS[name][1].get("mtp_num_hidden_layers"):
            return name, ""
        why = "has no MTP head" if name.startswith("tiny") else "is a real shape (see verify_cost for its figures)"
        return DEFAULT_MODEL, f"{name} {why}: exactness checked on {DEFAULT_MODEL}"
    if ModelConfig.from_pretrained(name).mtp_num_hidden_layers:
        return name, ""
    return DEFAULT_MODEL, f"{name} has no MTP head: exactness checked on {DEFAULT_MODEL}"


def mtp_speculative(
    model=DEFAULT_MODEL,
    device: str = "cpu",
    dtype: str = "float32",
    seed: int = 0,
    ks=(1, 2, 3),
    drafters=DRAFTERS,
    new_tokens: int = 64,
    sampling_runs: int = 400,
    alpha: float = 1e-3,
) -> Report:
    """Notebook 06: greedy equality for every drafter and k, the acceptance sweep, the sampling check."""
    model, note = checked_model(model)
    if dtype != "float32":  # token identity is a float32 contract; bf16 ties may flip either way
        note, dtype = (note + "; " if note else "") + f"checked in float32, not {dtype}", "float32"
    eq = greedy_equality(model, device, dtype, seed, ks=ks, drafters=drafters, new_tokens=new_tokens)
    sweep = acceptance_sweep(model, device, dtype, seed, ks=ks)
    samp = sampling_check(model, device, dtype, seed, runs=sampling_runs, alpha=alpha)
    sweep_ok = sweep.tokens_equal.all() and ((sweep.tokens_per_step - sweep.theory).abs() <= 0.35 * sweep.theory).all()
    summary = pd.DataFrame(
        [
            dict(
                check="greedy speculative == plain greedy (all drafters, k, slots interleaved)",
                cases=len(eq),
                failures=int((~eq["pass"]).sum()),
                detail=f"{new_tokens + 1} tokens x {int(eq.slots.max())} slots",
                **{"pass": bool(eq["pass"].all())},
            ),
            dict(
                check="oracle accepts every draft, adversarial none",
                cases=int(eq.drafter.isin(["oracle", "adversarial"]).sum()),
                failures=0,
                detail="",
                **{
                    "pass": bool(
                        (eq[eq.drafter == "oracle"].acceptance_rate == 1).all()
                        and (eq[eq.drafter == "adversarial"].acceptance_rate == 0).all()
                    )
                },
            ),
            dict(
                check="tokens per step follow (1-a^(k+1))/(1-a)",
                cases=len(sweep),
                failures=0,
                detail="within 35% (short runs)",
                **{"pass": bool(sweep_ok)},
            ),
            dict(
                check=f"sampling: chi-square vs plain sampling's law (alpha={alpha:g})",
                cases=len(samp),
                failures=int((~samp["pass"]).sum()),
                detail=", ".join(f"{r.drafter}: p={r.p_value:.3g}" for r in samp.itertuples()),
                **{"pass": bool(samp["pass"].all())},
            ),
        ]
    )
    summary.loc[1, "failures"] = int(not summary.loc[1, "pass"])
    summary.loc[2, "failures"] = int(not summary.loc[2, "pass"])
    if note:
        summary["detail"] = summary["detail"].where(summary.index > 0, summary["detail"] + f" ({note})")
    figures = dict(
        model=str(model),
        dtype=dtype,
        oracle_tokens_per_step_k3=float(eq[(eq.drafter == "oracle") & (eq.k == max(ks))].tokens_per_step.iloc[0]),
        mtp_acceptance=float(eq[eq.drafter == "mtp"].acceptance_rate.mean()),
        sampling_min_p=float(samp[samp.law == "plain sampling"].p_value.min()),
    )
    return Report("mtp_speculative", summary, {"equality": eq, "sweep": sweep, "sampling": samp}, figures)
