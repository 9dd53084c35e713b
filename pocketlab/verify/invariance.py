"""Batch invariance: a request's logits must not depend on what else the engine runs, bit for bit.

Every sequence is first run solo (prefill, then greedy decode steps, nothing else in the engine). The same
sequences then run under schedules that change everything around them: all slots in one batch, slots
interleaved one call at a time, random subsets of slots per step (every batch size and graph bucket),
generate() with requests arriving in a shuffled order, prefill cut into chunks, and a prefill served from the
prefix cache. Each step's logits are compared with the solo run's with torch.equal. In the batch-invariant
mode every comparison must be bitwise; in the default mode the table shows where sequences first diverge.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pandas as pd
import torch

from ..requests import BatchedRequest
from ..sampling import SamplingParams
from .common import Report, as_pair, load_pair, random_prompts, seq_len_for, single_thread_on_cpu

CASES = ("batched", "interleaved", "random_subsets", "generate", "chunked_prefill", "prefix_hit")


class Trace:
    """One sequence's greedy tokens and logits (kept on the device: thousands of steps are compared)."""

    def __init__(self):
        self.tokens: list[int] = []
        self.logits: list[torch.Tensor] = []

    def add(self, token: int, logits: torch.Tensor | None) -> None:
        self.tokens.append(int(token))
        if logits is not None:
            self.logits.append(logits.detach().float().clone())


def compare(ref: Trace, test: Trace) -> dict:
    """First step whose token differs, first step whose logits differ in any bit, and the largest difference
    before the tokens part (after that the sequences are no longer comparable)."""
    n = min(len(ref.tokens), len(test.tokens))
    first_token = next((k for k in range(n) if ref.tokens[k] != test.tokens[k]), -1)
    upto = n if first_token < 0 else first_token + 1
    m = min(upto, len(test.logits))
    diffs = [float((ref.logits[k] - test.logits[k]).abs().max()) for k in range(m)]
    first_bit = next((k for k in range(m) if not torch.equal(ref.logits[k], test.logits[k])), -1)
    complete = len(test.tokens) == len(ref.tokens)
    return dict(
        steps=n,
        compared_logits=m,
        first_token_divergence=first_token,
        first_bitwise_difference=first_bit,
        max_abs_diff=max(diffs, default=0.0),
        tokens_equal=first_token < 0 and complete,
        bitwise=first_token < 0 and first_bit < 0 and complete and (m == n or not test.logits),
    )


def _greedy(eng, first, steps: int, slot: int) -> Trace:
    """The prefill result `first`, then `steps` greedy decode steps of the slot alone."""
    trace, r = Trace(), first
    trace.add(r.next_token, r.logits)
    for _ in range(steps):
        r = eng.decode_step(r.next_token, slot_id=slot)
        trace.add(r.next_token, r.logits)
    return trace


def _solo(eng, prompt: list[int], steps: int, slot: int) -> Trace:
    eng.reset()
    return _greedy(eng, eng.prefill(prompt, slot_id=slot), steps, slot)


def _slot_requests(eng, prompts) -> list[BatchedRequest]:
    """A reset engine with every slot free, and one request per prompt on the slot of its index."""
    eng.reset()
    for s in range(eng.num_slots):
        eng.release_slot(s)
    return [BatchedRequest(i, p, slot_id=i) for i, p in enumerate(prompts)]


def _batched(eng, prompts, steps, rng) -> list[Trace]:
    reqs = _slot_requests(eng, prompts)
    traces = [Trace() for _ in prompts]
    res = eng.batch_prefill(reqs)
    for t, r in zip(traces, res.results, strict=True):
        t.add(r.next_token, r.logits)
    for _ in range(steps):
        out = eng.batch_decode_step(reqs)
        for i, t in enumerate(traces):
            t.add(out.next_tokens[i], out.logits[i])
    return traces


def _interleaved(eng, prompts, steps, rng) -> list[Trace]:
    """One slot per call, in a new shuffled order every round (prefills land between other slots' decodes)."""
    eng.reset()
    traces = [Trace() for _ in prompts]
    for _ in range(steps + 1):
        for i in rng.sample(range(len(prompts)), len(prompts)):
            t = traces[i]
            r = eng.prefill(prompts[i], slot_id=i) if not t.tokens else eng.decode_step(t.tokens[-1], slot_id=i)
            t.add(r.next_token, r.logits)
    return traces


def _random_subsets(eng, prompts, steps, rng) -> list[Trace]:
    """Each call advances a random subset of the unfinished slots in ONE batch call: every batch size, in any
    mix of positions; prefills and decodes of different slots alternate."""
    reqs = _slot_requests(eng, prompts)
    traces = [Trace() for _ in prompts]
    while any(len(t.tokens) < steps + 1 for t in traces):
        live = [i for i, t in enumerate(traces) if len(t.tokens) < steps + 1]
        pick = sorted(rng.sample(live, rng.randint(1, len(live))))
        fresh = [i for i in pick if not traces[i].tokens]
        going = [i for i in pick if traces[i].tokens]
        if fresh:
            res = eng.batch_prefill([reqs[i] for i in fresh])
            for i, r in zip(fresh, res.results, strict=True):
                traces[i].add(r.next_token, r.logits)
        if going:
            out = eng.batch_decode_step([reqs[i] for i in going])
            for j, i in enumerate(going):
                traces[i].add(out.next_tokens[j], out.logits[j])
    return traces


def _generate(eng, prompts, steps, rng) -> list[Trace]:
    """Continuous batching with the requests in a shuffled arrival order (tokens only: generate() returns no
    logits)."""
    eng.reset()
    order = rng.sample(range(len(prompts)), len(prompts))
    out = eng.generate([prompts[i] for i in order], SamplingParams(max_new_tokens=steps + 1))
    traces = [Trace() for _ in prompts]
    for i, toks in zip(order, out, strict=True):
        for tok in toks:
            traces[i].add(tok, None)
    return traces


def _chunked(make_chunked, prompts, steps, rng) -> list[Trace]:
    """Each prompt prefilled in small chunks (a chunked engine) instead of one piece."""
    eng = make_chunked()
    return [_solo(eng, p, steps, i % eng.num_slots) for i, p in enumerate(prompts)]


def _prefix_hit(eng, prompts, steps, rng) -> list[Trace]:
    """Each prompt's first part is prefilled into another slot first, so the prompt reuses its K/V (and state
    checkpoints) from the prefix cache and computes only the rest."""
    traces = []
    for i, p in enumerate(prompts):
        eng.reset()
        slot, donor = i % eng.num_slots, (i + 1) % eng.num_slots
        eng.prefill(p[: max(1, len(p) - 3)], slot_id=donor)
        traces.append(_greedy(eng, eng.prefill(p, slot_id=slot), steps, slot))
    return traces


def _earliest(steps) -> int:
    """The first step any sequence differed at (-1: none did)."""
    return min((x for x in steps if x >= 0), default=-1)


@single_thread_on_cpu
def invariance(
    model="tiny-qwen3",
    device: str = "cpu",
    dtype: str = "float32",
    seed: int = 0,
    num_slots: int = 4,
    steps: int = 8,
    prompt_lens=None,
    batch_invariant: bool = True,
    cases=CASES,
    **options,
):
    """Table: one row per (case, sequence); summary: one row per case. `pass`: bitwise equal to the solo runs
    in the batch-invariant mode; in the default mode the tokens must agree (what the default mode promises
    is closeness, judged by the isolation and batch checks' tolerances, not bits)."""
    pair = as_pair(model, device, dtype, seed)
    lens = list(prompt_lens or [5 + (7 * i) % 29 for i in range(num_slots)])[:num_slots]
    prompts = random_prompts(pair.vocab_size, lens, seed + 1)
    opts = dict(max_slots=num_slots, max_seq_len=seq_len_for(lens, steps), batch_invariant=batch_invariant) | options
    eng = pair.engine(**opts)
    solo = [_solo(eng, p, steps, i) for i, p in enumerate(prompts)]
    rng = random.Random(seed)
    runners = dict(
        batched=lambda: _batched(eng, prompts, steps, rng),
        interleaved=lambda: _interleaved(eng, prompts, steps, rng),
        random_subsets=lambda: _random_subsets(eng, prompts, steps, rng),
        generate=lambda: _generate(eng, prompts, steps, rng),
        chunked_prefill=lambda: _chunked(lambda: pair.engine(**(opts | dict(prefill_chunk=3))), prompts, steps, rng),
        prefix_hit=lambda: _prefix_hit(eng, prompts, steps, rng),
    )
    rows = []
    for case in cases:
        try:
            traces, error = runners[case](), ""
        except Exception as e:  # a crash is a failed case, not a crashed notebook
            traces, error = [Trace() for _ in prompts], f"{type(e).__name__}: {e}"
        for i, (ref, got) in enumerate(zip(solo, traces, strict=True)):
            c = compare(ref, got)
            ok = (c["bitwise"] if batch_invariant else c["tokens_equal"]) and not error
            rows.append(dict(case=case, sequence=i, prompt_len=len(prompts[i]), **c, error=error, **{"pass": ok}))
    table = pd.DataFrame(rows)
    summary = (
        table.groupby("case", sort=False)
        .agg(
            sequences=("sequence", "size"),
            bitwise=("bitwise", "all"),
            tokens_equal=("tokens_equal", "all"),
            earliest_token_divergence=("first_token_divergence", _earliest),
            earliest_bitwise_difference=("first_bitwise_difference", _earliest),
            max_abs_diff=("max_abs_diff", "max"),
            error=("error", "first"),
            **{"pass": ("pass", "all")},
        )
        .reset_index()
    )
    mode = "batch_invariant" if batch_invariant else "default"
    figures = dict(
        model=pair.name,
        dtype=pair.dtype,
        mode=mode,
        slots=num_slots,
        steps=steps,
        bitwise_cases=int(summary.bitwise.sum()),
        cases=len(summary),
        differing_logit_steps=int((table.first_bitwise_difference >= 0).sum()),
    )
    return Report(f"invariance[{mode}]", summary, {"sequences": table}, figures)


def main(argv=None) -> int:
    """Both modes for one model: the per-sequence table (CSV) and the summary; exit 1 if the batch-invariant
    mode differs anywhere."""
    ap = argparse.ArgumentParser(prog="python -m pocketlab.verify.invariance", description=main.__doc__)
    ap.add_argument("--model", default="tiny-qwen3")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="", help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--out", type=Path, default=None, help="CSV of every (mode, case, sequence)")
    a = ap.parse_args(argv)
    dtype = a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32")
    pair = load_pair(a.model, a.device, dtype)
    cases = tuple(c for c in a.cases.split(",") if c)
    reports = {
        mode: invariance(pair, num_slots=a.slots, steps=a.steps, batch_invariant=mode == "batch_invariant", cases=cases)
        for mode in ("default", "batch_invariant")
    }
    table = pd.concat([r.tables["sequences"].assign(mode=m, model=a.model, dtype=dtype) for m, r in reports.items()])
    print(pd.concat([r.summary.assign(mode=m) for m, r in reports.items()]).to_string())
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        table.to_csv(a.out, index=False)
    return 0 if reports["batch_invariant"].passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
