"""Prefix cache: a hit must compute exactly what a cold engine computes, reuse exactly what it claims, never
reuse a stale prefix, and stay within its memory budget without touching live slots.

The reference is an engine built from the same weights with `prefix_cache=False`: every prompt computed in
full. Each prompt below runs prefill + greedy decode on both; tokens must be equal and logits within the
parity tolerance, and `reused_tokens` / `computed_tokens` must equal what the cache design promises: the
whole shared prefix for dense models; for hybrid models the nearest state checkpoint at or below it
(checkpoints sit at prompt ends, released slots' ends and multiples of `checkpoint_stride`).

    from pocketlab.verify.prefix import prefix_cache
    r = prefix_cache(model="tiny-qwen3_5")      # Report: summary, tables cases/stale/eviction/workloads

What a hit saves: verify.ttft.
"""

from __future__ import annotations

import pandas as pd

from ..sampling import SamplingParams
from .common import Report, Run, as_pair, compare_runs, random_prompts, single_thread_on_cpu, tolerance


# -- running -------------------------------------------------------------------------------------
def _run(eng, prompt: list[int], steps: int, slot: int) -> tuple[Run, int, int]:
    """Prefill + `steps` greedy decodes on one slot: the run, reused and computed prompt tokens."""
    run = Run()
    r = eng.prefill(prompt, slot_id=slot)
    reused, computed = r.reused_tokens, r.computed_tokens
    run.add(r.next_token, r.logits)
    for _ in range(steps):
        r = eng.decode_step(r.next_token, slot_id=slot)
        run.add(r.next_token, r.logits)
    return run, reused, computed


class _Cold:
    """The reference: the same weights with the prefix cache off, every prompt computed from scratch."""

    def __init__(self, eng):
        self.eng, self.memo = eng, {}

    def __call__(self, prompt: list[int], steps: int) -> Run:
        key = (tuple(prompt), steps)
        if key not in self.memo:
            self.eng.reset()
            self.memo[key] = _run(self.eng, prompt, steps, 0)[0]
        return self.memo[key]


def _diverge(prefix: list[int], continuation: list[int], vocab: int) -> list[int]:
    """prefix + continuation, its first token changed so nothing else shares one more token by accident."""
    return prefix + [(continuation[0] + 1) % vocab] + continuation[1:]


def _checkpoints(stride: int, *ends: int) -> list[int]:
    """Where a hybrid prefill from position 0 keeps states: stride multiples up to each end, and the ends."""
    points = set(ends)
    for end in ends:
        points |= set(range(stride, end + 1, stride)) if stride else set()
    return sorted(points)


def _row(section: str, case: str, slot: int, prompt: list[int], got: tuple, ref: Run, expected: int, tol) -> dict:
    run, reused, computed = got
    c = compare_runs(ref, run, tol)
    counts_ok = reused == expected and computed == len(prompt) - expected
    return dict(
        section=section,
        case=case,
        slot=slot,
        prompt_len=len(prompt),
        expected_reused=expected,
        reused=reused,
        computed=computed,
        counts_exact=counts_ok,
        tokens_equal=c["tokens_equal"],
        max_abs_diff=c["max_abs_diff"],
        bound=c["bound"],
        **{"pass": bool(c["pass"] and counts_ok)},
    )


# -- the check -----------------------------------------------------------------------------------
@single_thread_on_cpu
def prefix_cache(
    model="tiny-qwen3",
    device: str = "cpu",
    dtype: str = "float32",
    seed: int = 0,
    prompt_len: int = 40,
    decode_steps: int = 4,
    prefill_chunk: int = 16,
    checkpoint_stride: int = 8,
    prefix_block: int = 4,
    requests: int = 8,
    system_len: int = 48,
    question_len: int = 6,
    turns: int = 3,
) -> Report:
    """Tables: `cases` (hits in the same slot, another slot, a released slot, a retained entry, on and off the
    stride, with another slot decoding in between), `stale` (prompts diverging at every position of a block),
    `eviction` (a tiny budget: bounded, LRU, live slots untouched), `workloads` (hit rates, tokens saved)."""
    if prompt_len < 2 * checkpoint_stride + 4 or prompt_len < 2 * prefix_block + 4:
        raise ValueError(f"prompt_len={prompt_len} is too short for stride {checkpoint_stride} / block {prefix_block}")
    if requests <= 4:
        raise ValueError(f"requests={requests}: need more than the 4 slots, or the first batch takes them all")
    pair = as_pair(model, device, dtype, seed)
    dtype = pair.dtype  # a Pair passed in brings its own dtype
    tol = tolerance(dtype)
    opts = dict(
        max_slots=4,
        max_seq_len=max(
            256, system_len + turns * (question_len + decode_steps + 2) + 8, 2 * prompt_len + 4 * decode_steps + 32
        ),
        prefill_chunk=prefill_chunk,
        checkpoint_stride=checkpoint_stride,
        prefix_block=prefix_block,
    )
    cold = _Cold(pair.engine(**opts, prefix_cache=False))
    eng = pair.engine(**opts)
    assert eng.prefix is not None  # prefix_cache is on by default
    hybrid = eng.prefix.stateful
    V = pair.vocab_size
    texts = random_prompts(V, [prompt_len, 12, 16, 16, 16, 16], seed + 1)
    cases = _cases(eng, cold, texts, decode_steps, checkpoint_stride, hybrid, tol, V)
    stale = _stale(eng, cold, texts[0], checkpoint_stride, prefix_block, hybrid, tol, V)
    eviction = _eviction(pair, opts, cold, decode_steps, prompt_len, hybrid, tol, seed)
    workloads = _workloads(pair, opts, requests, system_len, question_len, turns, decode_steps, seed)
    cases, stale = pd.DataFrame(cases), pd.DataFrame(stale)
    summary = pd.DataFrame(
        [
            _summary(
                "cache hit == cold run (tokens, logits), counts exact",
                cases,
                f"max|diff| {cases.max_abs_diff.max():.3g}; {tol.describe()}",
            ),
            _summary(
                "stale prefixes never reused (divergence at every position)",
                stale,
                f"positions {stale.diverge_at.min()}..{stale.diverge_at.max()}",
            ),
            _summary(
                "LRU eviction within budget, live slots untouched",
                eviction,
                f"budget {int(eviction.budget.max())} B, evicted {int(eviction.evicted.max())}",
            ),
            _summary(
                "workloads: outputs == cold, reuse as designed",
                workloads,
                "; ".join(f"{w.workload}: {w.tokens_saved:.0%} saved" for w in workloads.itertuples()),
            ),
        ]
    )
    figures = dict(
        model=pair.name,
        dtype=dtype,
        hybrid=hybrid,
        cases=len(cases),
        max_abs_diff_vs_cold=float(max(cases.max_abs_diff.max(), stale.max_abs_diff.max())),
        stale_cases=len(stale),
        evicted=int(eviction.evicted.max()),
        **{f"{w.workload}_tokens_saved": float(w.tokens_saved) for w in workloads.itertuples()},
        **{f"{w.workload}_hit_rate": float(w.hit_rate) for w in workloads.itertuples()},
    )
    return Report(
        "prefix_cache", summary, {"cases": cases, "stale": stale, "eviction": eviction, "workloads": workloads}, figures
    )


def _summary(check: str, table: pd.DataFrame, detail: str) -> dict:
    return dict(
        check=check,
        cases=len(table),
        failures=int((~table["pass"]).sum()),
        detail=detail,
        **{"pass": bool(len(table)) and bool(table["pass"].all())},
    )


def _cases(eng, cold, texts, steps, stride, hybrid, tol, V) -> list[dict]:
    A, B = texts[0], texts[1]
    L = len(A)
    ck_A = _checkpoints(stride, L)

    def expect(shared: int, points=ck_A) -> int:
        return shared if not hybrid else max([p for p in points if p <= shared], default=0)

    rows, background = [], Run()
    bg = eng.prefill(B, slot_id=3)  # slot 3 decodes one step between every case
    background.add(bg.next_token, bg.logits)

    def tick():
        r = eng.decode_step(background.tokens[-1], slot_id=3)
        background.add(r.next_token, r.logits)

    def case(name, slot, prompt, expected, between=True):
        got = _run(eng, prompt, steps, slot)
        rows.append(_row("cases", name, slot, prompt, got, cold(prompt, steps), expected, tol))
        if between:
            tick()
        return got[0]

    a_on = (L // stride - 1) * stride  # a shared length on the stride
    a_off = L - 3 if (L - 3) % stride else L - 4  # ... and one off it
    first = case("cold prompt", 0, A, 0)
    hist0 = A + first.tokens[:-1]
    turn2 = hist0 + [first.tokens[-1]] + texts[2][:3]
    case("same slot: next turn (live end)", 0, turn2, len(hist0))
    case("other slot: shared prefix off the stride", 1, _diverge(A[:a_off], texts[3], V), expect(a_off))
    p2 = _diverge(A[:a_on], texts[4][:4], V)
    case("other slot: shared prefix on the stride", 2, p2, expect(a_on))
    case("same slot: diverges below its history", 1, _diverge(A[: a_on - 3], texts[5], V), expect(a_on - 3))
    case("another slot: slot 0's first prompt again (last token computed)", 2, A, expect(L - 1))
    # slot 2 is released: its rows keep the prompt it ran last (A + decode), its end state is checkpointed
    hist2 = eng.cache.slots[2].tokens[:]
    eng.release_slot(2)
    case("released slot's history, in another slot", 1, hist2 + texts[4][4:8], len(hist2))
    # slot 0 is overwritten by an unrelated prompt: its history must survive as a retained entry
    hist0b = eng.cache.slots[0].tokens[:]
    case("overwritten slot: unrelated prompt", 0, texts[5][::-1], 0)
    case("retained entry after the overwrite", 2, hist0b + texts[2][3:7], len(hist0b))
    rows.append(
        _row(
            "cases",
            "slot decoding in between all along",
            3,
            B,
            (background, 0, len(B)),
            cold(B, len(background.tokens) - 1),
            0,
            tol,
        )
    )
    eng.reset()
    case("after reset(): nothing reused", 0, turn2, 0, between=False)
    return rows


def _stale(eng, cold, A, stride, block, hybrid, tol, V) -> list[dict]:
    """Every position of one stride block (and of the hash blocks in it): a prompt equal to A except at that
    position, alternately in A's slot and in another one. Exactly the tokens before it may be reused."""
    eng.reset()
    eng.prefill(A, slot_id=0)
    ck_A = _checkpoints(stride, len(A))
    span = max(stride, block)
    rows = []
    for d in range(span, 2 * span + 1):
        prompt = A[:d] + [(A[d] + 1) % V] + A[d + 1 :]
        slot = d % 2
        expected = d if not hybrid else max([p for p in ck_A if p <= d], default=0)
        got = _run(eng, prompt, 1, slot)
        row = _row("stale", f"diverge at {d}", slot, prompt, got, cold(prompt, 1), expected, tol)
        rows.append(dict(diverge_at=d, **row))
    return rows


def _eviction(pair, opts, cold, steps, prompt_len, hybrid, tol, seed) -> pd.DataFrame:
    """A budget for about two retained prompts: overwrite slot 0 with one prompt after another, then check
    the bound at every step, that the newest retained prompt is a hit and the oldest was evicted, and that
    slots 1..3, live all along, continue exactly and still hand over their full history."""
    n = 6
    prompts = random_prompts(pair.vocab_size, [prompt_len] * (n + 3), seed + 7)
    probe = pair.engine(**opts)  # measure one retained prompt (K/V + its checkpoints)
    for p in prompts[:2]:
        probe.prefill(p, slot_id=0)
    budget = 3 * sum(c["bytes"] for c in probe.prefix.contents() if c["kind"] == "entry")
    eng = pair.engine(**opts, prefix_cache_bytes=budget)
    live = {s: _run(eng, prompts[n + s - 1], steps, s) for s in (1, 2, 3)}
    rows = []

    def row(check, ok, **kw):
        rows.append(
            dict(
                check=check,
                budget=budget,
                used=eng.prefix.used,
                evicted=eng.prefix.stats["evicted"],
                **kw,
                **{"pass": bool(ok and eng.prefix.used <= budget)},
            )
        )

    for i in range(n):  # each new prompt overwrites slot 0 and retains the previous one
        _run(eng, prompts[i], 0, 0)
        row(f"slot 0 <- prompt {i}: used <= budget", True)
    newest, oldest = prompts[n - 2], prompts[0]
    probe_new = _run(eng, newest + [1, 2], 0, 0)
    row("newest retained prompt is a hit", probe_new[1] == len(newest), reused=probe_new[1])
    probe_old = _run(eng, oldest + [1, 2], 0, 0)
    row("oldest retained prompt was evicted (LRU)", probe_old[1] == 0, reused=probe_old[1])
    for s, (run, _, _) in live.items():
        prompt = prompts[n + s - 1]
        more = Run(list(run.tokens), list(run.logits))
        for _ in range(steps):
            r = eng.decode_step(more.tokens[-1], slot_id=s)
            more.add(r.next_token, r.logits)
        c = compare_runs(cold(prompt, 2 * steps), more, tol)
        row(f"live slot {s} continues like a cold run", c["pass"], max_abs_diff=c["max_abs_diff"])
        hist = eng.cache.slots[s].tokens[:]
        turn = _run(eng, hist + [more.tokens[-1], 5], steps, s)
        c = compare_runs(cold(hist + [more.tokens[-1], 5], steps), turn[0], tol)
        row(
            f"live slot {s}: next turn reuses its whole history",
            c["pass"] and turn[1] == len(hist),
            reused=turn[1],
            max_abs_diff=c["max_abs_diff"],
        )
    return pd.DataFrame(rows)


def _workloads(pair, opts, requests, system_len, question_len, turns, steps, seed) -> pd.DataFrame:
    """Two traffic shapes through the engine and through the cold reference: a shared system prompt served by
    generate() (continuous batching over the slots), and multi-turn chats interleaved over the slots."""
    V = pair.vocab_size
    rows = []
    system = random_prompts(V, [system_len], seed + 11)[0]
    questions = random_prompts(V, [question_len] * requests, seed + 12)
    prompts = [system + q for q in questions]
    params = SamplingParams(max_new_tokens=steps)
    for name, run in (
        ("shared system prompt (generate)", lambda e: e.generate(prompts, params)),
        ("multi-turn chat", lambda e: _chats(e, V, question_len, turns, steps, seed)),
    ):
        cold = pair.engine(**opts, prefix_cache=False)
        eng = pair.engine(**opts)
        out_cold, out = run(cold), run(eng)
        st = eng.prefix.stats
        total = st["reused_tokens"] + st["computed_tokens"]
        rows.append(
            dict(
                workload=name,
                requests=st["prefills"],
                prompt_tokens=total,
                computed_cold=total,
                reused=st["reused_tokens"],
                computed=st["computed_tokens"],
                hit_rate=st["hits"] / max(st["prefills"], 1),
                tokens_saved=st["reused_tokens"] / max(total, 1),
                outputs_equal_cold=out == out_cold,
                **{"pass": bool(out == out_cold and st["hits"] > 0)},
            )
        )
    return pd.DataFrame(rows)


def _chats(eng, V, question_len, turns, steps, seed) -> list[list[int]]:
    """Each slot holds one conversation; every turn appends the answer and a new question to its history."""
    n = eng.options.max_slots
    asks = random_prompts(V, [question_len] * (n * turns), seed + 13)
    history: list[list[int]] = [[] for _ in range(n)]
    outputs = []
    for t in range(turns):
        for s in range(n):
            prompt = history[s] + asks[t * n + s]
            run, _, _ = _run(eng, prompt, steps - 1, s)
            history[s] = prompt + run.tokens
            outputs.append(run.tokens)
    return outputs
