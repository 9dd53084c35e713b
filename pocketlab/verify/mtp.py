"""MTP speculative decoding: exact (greedy token-identical, sampling distribution-identical) and what it costs.

    greedy_equality(...)   every drafter x k: batched, interleaved slots give plain greedy decoding's tokens
    acceptance_sweep(...)  tokens per step against the per-draft acceptance rate, measured vs (1-a^(k+1))/(1-a)
    sampling_check(...)    chi-square of speculative samples against the exact joint law of plain sampling
    mtp_speculative(...)   the three as one Report (notebook 06)
    verify_cost(...)       on any device: verify step vs plain step, oracle tokens/s, break-even acceptance

Drafters: "mtp" (the checkpoint's head), "oracle" (the known greedy continuation: every draft right),
"adversarial" (every draft wrong), "oracle@0.5" (each draft right with probability 0.5).
"""

from __future__ import annotations

import contextlib
import functools

import pandas as pd
import torch

from ..config import DTYPES, EngineOptions, ModelConfig
from ..engine import QwenEngine
from ..requests import BatchedRequest
from ..sampling import SamplingParams, filtered_probs
from ..speculative import MTPDrafter
from ..tools.synthetic import PRESETS, build_hf_model, ensure_checkpoint, mtp_weights
from ..tools.timing import Clock
from .common import Report, checkpoint_root, random_prompts, single_thread_on_cpu, solo_run
from .drafters import AdversarialDrafter, OracleDrafter

DEFAULT_MODEL = "tiny-qwen3_5-mtp"
DRAFTERS = ("mtp", "oracle", "adversarial", "oracle@0.5")


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Tokens a slot gains per step when each draft is accepted independently with probability alpha."""
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def break_even(cost_ratio: float, k: int) -> float:
    """The per-draft acceptance rate at which a step costing `cost_ratio` plain steps breaks even (nan: never)."""
    if cost_ratio <= 1:
        return 0.0
    if cost_ratio >= k + 1:
        return float("nan")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens_per_step(mid, k) < cost_ratio else (lo, mid)
    return (lo + hi) / 2


def use_drafter(eng: QwenEngine, name: str, references: dict[int, list[int]] | None):
    """Point the engine's speculator at a drafter by name; returns it."""
    spec = eng.speculator
    if name == "mtp":
        return spec.use(MTPDrafter())
    if name == "adversarial":
        return spec.use(AdversarialDrafter(references))
    if name.startswith("oracle"):
        accuracy = float(name.split("@")[1]) if "@" in name else 1.0
        return spec.use(OracleDrafter(references, accuracy=accuracy))
    raise ValueError(f"unknown drafter {name!r}; known: {DRAFTERS}")


# -- runs ----------------------------------------------------------------------------------------
def plain_greedy(eng: QwenEngine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Full sequences (prompt + new_tokens + 1 greedy tokens), each slot alone, speculation off."""
    out = []
    with plain(eng):
        for s, p in enumerate(prompts):
            out.append(list(p) + solo_run(eng, p, new_tokens, slot=s).tokens)
            eng.reset(s)
    return out


@contextlib.contextmanager
def plain(eng: QwenEngine):
    """The engine without its speculator (plain decode steps) for the duration."""
    spec, eng.speculator = eng.speculator, None
    try:
        yield eng
    finally:
        eng.speculator = spec


def interleaved(
    eng: QwenEngine, prompts: list[list[int]], new_tokens: int, sampling: list[SamplingParams] | None = None
) -> tuple[list[BatchedRequest], list[dict]]:
    """Slot 0 is prefilled and decoded alone first; the others are prefilled in one batch; then rounds of
    (all live slots in one batch_decode_step), (the last one alone via decode_step), (all but the first, in
    reverse order), until every slot has new_tokens + 1 tokens. Returns the requests and, per call, its kind,
    slots and forwards run."""
    sampling = sampling or [SamplingParams()] * len(prompts)
    reqs = [
        BatchedRequest(100 + i, list(p), slot_id=i, sampling=sp)
        for i, (p, sp) in enumerate(zip(prompts, sampling, strict=True))
    ]
    need, calls = new_tokens + 1, []

    def call(kind, rs, fn):
        before = eng.forward_count
        out = fn()
        calls.append(dict(call=kind, slots=[r.slot_id for r in rs], forwards=eng.forward_count - before))
        return out

    r = call("prefill", reqs[:1], lambda: eng.prefill(prompts[0], slot_id=0, sampling=sampling[0]))
    reqs[0].generated_tokens = [r.next_token]
    if len(reqs) > 1:
        call("batch_prefill", reqs[1:], lambda: eng.batch_prefill(reqs[1:]))
    rnd = 0
    while True:
        live = [r for r in reqs if len(r.generated_tokens) < need]
        if not live:
            break
        if rnd % 3 == 1 or len(live) == 1:
            one = live[-1]
            res = call(
                "decode_step", [one], functools.partial(eng.decode_step, one.last_token, one.slot_id, one.sampling)
            )
            one.generated_tokens.extend(res.tokens)
        else:
            group = live if rnd % 3 == 0 else live[::-1][:-1]
            call("batch_decode_step", group, functools.partial(eng.batch_decode_step, group))
        rnd += 1
    return reqs, calls


def _model_engine(model, device, dtype, seed, **options):
    """(engine maker, vocab) for a preset or checkpoint; real-shape presets get random MTP weights in memory."""
    name = str(model)
    if name in PRESETS and not name.startswith("tiny"):
        torch_dtype = DTYPES[dtype]
        hf = build_hf_model(name, seed, device, torch_dtype, mtp_num_hidden_layers=1)
        cfg = ModelConfig.from_dict(hf.config.to_dict())
        weights = dict(hf.state_dict()) | mtp_weights(cfg, seed, device, torch_dtype)
        del hf
        return (
            lambda **o: QwenEngine(cfg, weights, EngineOptions(device=device, dtype=dtype, **(options | o)))
        ), cfg.vocab_size
    path = ensure_checkpoint(name, checkpoint_root(), seed) if name in PRESETS else name
    cfg = ModelConfig.from_pretrained(path)
    return (
        lambda **o: QwenEngine.from_pretrained(path, EngineOptions(device=device, dtype=dtype, **(options | o)))
    ), cfg.vocab_size


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
) -> pd.DataFrame:
    """One row per (drafter, k): do all slots' tokens equal plain greedy decoding's? Plus acceptance figures
    and whether every batch call ran exactly one model forward."""
    make, vocab = _model_engine(model, device, dtype, seed)
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
    make, vocab = _model_engine(model, device, dtype, seed)
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
    make, vocab = _model_engine(model, device, dtype, seed)
    prompt = random_prompts(vocab, [prompt_len], seed)[0]
    eng = make(speculative_tokens=k, max_slots=slots, max_seq_len=prompt_len + depth + k + 8, prefill_chunk=16)
    base = SamplingParams(temperature=temperature, top_k=top_k)
    law = exact_joint(eng, prompt, base, depth)
    wrong = exact_joint(eng, prompt, SamplingParams(temperature=temperature * wrong_temperature, top_k=top_k), depth)
    greedy = plain_greedy(eng, [prompt], depth + k)[0]
    refs = {j: greedy for j in range(slots)}
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


# -- cost ----------------------------------------------------------------------------------------
def _back_to_prefill(eng: QwenEngine, reqs: list[BatchedRequest], snaps: list) -> None:
    """Every slot as right after the batch prefill (slot i = request i): its snapshot, its first token."""
    for i, (r, snap) in enumerate(zip(reqs, snaps, strict=True)):
        eng.restore(snap, i)
        r.generated_tokens = r.generated_tokens[:1]


def _timed_steps(eng: QwenEngine, clock, reqs: list[BatchedRequest], warmup: int, n_steps: int):
    """(times of n_steps batch decode steps after `warmup` untimed ones, tokens all of them produced)."""
    times, before = [], sum(len(r.generated_tokens) for r in reqs)
    step = functools.partial(eng.batch_decode_step, reqs)
    for i in range(warmup + n_steps):
        t = clock.time(step)
        if i >= warmup:
            times.append(t)
    return times, sum(len(r.generated_tokens) for r in reqs) - before


@single_thread_on_cpu
def verify_cost(
    model: str = "qwen3.5-9b",
    device: str = "cuda",
    dtype: str = "bfloat16",
    seed: int = 0,
    ks=(1, 2, 3),
    batch_sizes=(1,),
    prompt_len: int = 128,
    steps: int = 8,
    warmup: int = 2,
    rollbacks=("states", "replay"),
    quantile: float = 0.5,
    cuda_graphs: bool = True,
    engine_options: dict | None = None,
) -> pd.DataFrame:
    """Step times (ms) per batch size and k: plain decode (CUDA graphs where the engine uses them, and
    eager), speculative with the oracle (all accepted: the verify step's own cost), adversarial (all
    rejected: verify + rollback, per rollback strategy) and the MTP head (drafting + verify; random heads
    mostly reject). Derived: oracle tokens/s and speed-up (measured, and at full acceptance), the MTP
    head's drafting time, and the break-even per-draft acceptance rate of the MTP step (alpha where
    (1 - alpha^(k+1)) / (1 - alpha) = t_mtp / t_plain).
    Real-shape presets are built in memory with random weights plus random MTP weights."""
    clock = Clock(device, quantile)
    B_max, k_max = max(batch_sizes), max(ks)
    total = (steps + warmup) * (k_max + 1) + k_max + 2
    make, vocab = _model_engine(model, device, dtype, seed)
    eng = make(
        **(
            dict(
                speculative_tokens=k_max,
                max_slots=B_max,
                max_seq_len=prompt_len + total + 8,
                cuda_graphs=cuda_graphs,
                prefix_cache=False,
            )
            | (engine_options or {})
        )
    )
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for B in batch_sizes:
        eng.reset()
        prompts = [torch.randint(0, vocab, (prompt_len,), generator=gen).tolist() for _ in range(B)]
        reqs = [BatchedRequest(i, p, slot_id=i) for i, p in enumerate(prompts)]
        eng.batch_prefill(reqs)
        restore = functools.partial(_back_to_prefill, eng, reqs, [eng.snapshot(i) for i in range(B)])
        timed = functools.partial(_timed_steps, eng, clock, reqs, warmup)

        with plain(eng):  # plain greedy: the reference continuation and the plain step time
            restore()
            plain_t, _ = timed(total - warmup)
            refs = {i: prompts[i] + r.generated_tokens for i, r in enumerate(reqs)}
            graphs, eng.graphs = eng.graphs, None
            restore()
            eager_t, _ = timed(steps)
            eng.graphs = graphs
        t_plain, t_eager = clock.pick(plain_t), clock.pick(eager_t)
        for k in ks:
            eng.speculator.k = k
            row = dict(
                model=str(model),
                device=device,
                dtype=dtype,
                batch=B,
                k=k,
                plain_ms=t_plain * 1e3,
                plain_eager_ms=t_eager * 1e3,
            )
            for name, modes in (("oracle", rollbacks), ("adversarial", rollbacks), ("mtp", rollbacks[:1])):
                for mode in modes:
                    eng.speculator.rollback = mode
                    use_drafter(eng, name, refs)
                    restore()
                    eng.speculator.stats = type(eng.speculator.stats)()
                    times, emitted = timed(steps)
                    key = name if mode == rollbacks[0] else f"{name}_{mode}"
                    row[f"{key}_ms"] = clock.pick(times) * 1e3
                    row[f"{key}_tokens_per_step"] = emitted / ((warmup + steps) * B)
            eng.speculator.rollback = rollbacks[0]
            row["verify_over_plain"] = row["oracle_ms"] / row["plain_ms"]
            row["oracle_tok_s"] = B * row["oracle_tokens_per_step"] / (row["oracle_ms"] / 1e3)
            row["plain_tok_s"] = B / t_plain
            row["oracle_speedup"] = row["oracle_tok_s"] / row["plain_tok_s"]
            # what a step at the oracle's cost yields if every draft holds (bf16 near-ties can flip a reference
            # token computed by plain decoding, so the measured oracle may fall short of k + 1)
            row["full_acceptance_speedup"] = (k + 1) * row["plain_ms"] / row["oracle_ms"]
            row["mtp_draft_ms"] = row["mtp_ms"] - row["oracle_ms"]  # the MTP head's drafting, roughly
            row["mtp_over_plain"] = row["mtp_ms"] / row["plain_ms"]
            row["break_even_acceptance"] = break_even(row["mtp_over_plain"], k)
            row["break_even_acceptance_eager"] = break_even(row["mtp_ms"] / row["plain_eager_ms"], k)
            rows.append(row)
    return pd.DataFrame(rows)
