"""Batch API: ragged batch_prefill + batch_decode_step must equal solo runs, run ONE forward per call,
keep BatchedRequest bookkeeping right, and reject every misuse before touching any slot's state.

Sampled requests too: each batched request must draw its tokens from its own (seed, position), whatever row
it runs in. In bf16/fp16 the logit bound is calibrated per step from the engine's own rounding noise
(common.NoiseMeter); in every dtype a token may differ only where the logits' difference explains it.
"""

from __future__ import annotations

import math
from typing import Any, cast

import pandas as pd
import torch

from ..requests import BatchedRequest
from ..sampling import SamplingParams, filtered_probs
from .common import (
    NoiseMeter,
    Report,
    Run,
    as_pair,
    compare_runs,
    random_prompts,
    seq_len_for,
    single_thread_on_cpu,
    solo_run,
    step_metrics,
    tolerance,
)


def default_prompt_lens(num_slots: int, prefill_chunk: int) -> list[int]:
    """Ragged, from 1 token up to exactly one chunk: all fit in one prefill forward."""
    if num_slots == 1:
        return [prefill_chunk]
    return [1 + (prefill_chunk - 1) * i // (num_slots - 1) for i in range(num_slots)]


@single_thread_on_cpu
def batch_api(
    model="tiny-qwen3",
    device: str = "cpu",
    dtype: str = "float32",
    seed: int = 0,
    num_slots: int = 3,
    prompt_lens=None,
    decode_steps: int = 6,
    prefill_chunk: int = 8,
) -> Report:
    """Tables: `requests` (batch vs solo), `forwards`, `bookkeeping`, `errors`; summary per section."""
    pair = as_pair(model, device, dtype, seed)
    dtype = pair.dtype
    tol = tolerance(dtype)
    lens = list(prompt_lens or default_prompt_lens(num_slots, prefill_chunk))
    prompts = random_prompts(pair.vocab_size, lens, seed)
    # one spare slot beyond those allocated, so "a slot outside the allocation" exists physically
    opts = dict(
        max_slots=max(num_slots, 3) + 1, max_seq_len=seq_len_for(lens, decode_steps + 1), prefill_chunk=prefill_chunk
    )
    eng, noise_of = pair.engine(**opts), NoiseMeter(pair, **opts)
    solo, noise = [], []
    for p in prompts:
        eng.reset()
        solo.append(solo_run(eng, p, decode_steps + 1, slot=0))
        noise.append(noise_of(p, solo[-1]))
    sampled = _sampled(eng, prompts, decode_steps, tol, noise_of)

    requests, logits, forwards, book = _batched(eng, prompts, decode_steps, prefill_chunk)
    rows = []
    for r, p, ref, lg, own in zip(requests, prompts, solo, logits, noise, strict=True):
        run = Run(list(r.generated_tokens), lg)
        ref = _prefix(ref, len(run.tokens))
        c = compare_runs(ref, run, tol, own)
        rows.append(dict(request_id=r.request_id, slot=r.slot_id, prompt_len=len(p), **c))
    table = pd.DataFrame(rows)
    book += _reuse_after_release(eng, requests, logits, solo, tol, noise)
    errors = error_cases(eng, prompts[-1], solo[-1], tol, noise[-1])
    book_df, fwd_df = pd.DataFrame(book, columns=["check", "expected", "actual", "pass"]), pd.DataFrame(forwards)
    summary = pd.DataFrame(
        [
            dict(
                check="batch == solo (tokens, logits)",
                cases=len(table),
                failures=int((~table["pass"]).sum()),
                detail=f"max|diff| {table.max_abs_diff.max():.3g}; {tol.describe(calibrated=True)}",
                **{"pass": bool(table["pass"].all())},
            ),
            dict(
                check="sampled: batch == solo, each draw from its own (seed, position)",
                cases=len(sampled),
                failures=int((~sampled["pass"]).sum()),
                detail=f"{int(sampled.tokens_equal.sum())}/{len(sampled)} token-identical to solo",
                **{"pass": bool(sampled["pass"].all())},
            ),
            dict(
                check="one forward per batch call",
                cases=len(fwd_df),
                failures=int((~fwd_df["pass"]).sum()),
                detail=f"forwards per call: {sorted(set(fwd_df.actual))}",
                **{"pass": bool(fwd_df["pass"].all())},
            ),
            dict(
                check="BatchedRequest / slot bookkeeping",
                cases=len(book_df),
                failures=int((~book_df["pass"]).sum()),
                detail="",
                **{"pass": bool(book_df["pass"].all())},
            ),
            dict(
                check="errors raised, state unchanged",
                cases=len(errors),
                failures=int((~errors["pass"]).sum()),
                detail=f"{int(errors.state_unchanged.sum())}/{len(errors)} left every slot untouched",
                **{"pass": bool(errors["pass"].all())},
            ),
        ]
    )
    figures = dict(
        model=pair.name,
        dtype=dtype,
        requests=len(table),
        max_abs_diff_vs_solo=float(table.max_abs_diff.max()),
        forwards_per_call=",".join(map(str, sorted(set(fwd_df.actual)))),
        error_cases=len(errors),
        error_cases_ok=int(errors["pass"].sum()),
    )
    return Report(
        "batch_api",
        summary,
        {"requests": table, "sampled": sampled, "forwards": fwd_df, "bookkeeping": book_df, "errors": errors},
        figures,
    )


def _drawn_by_own_uniform(logits: torch.Tensor, token: int, sp: SamplingParams, position: int, margin=1e-4) -> bool:
    """Does `token` lie where the request's own uniform for `position` falls in the sampling CDF of these
    logits, give or take `margin` of the mass? (The default 1e-4 allows for the device's own cumsum rounding.)"""
    probs = filtered_probs(logits.float()[None], [sp])[0].double()
    cdf = probs.cumsum(0)
    target = max(sp.uniform(position), 1e-9) * float(cdf[-1])
    return float(cdf[token] - probs[token]) - margin <= target <= float(cdf[token]) + margin


def _cdf_shift(a: torch.Tensor, b: torch.Tensor, sp: SamplingParams, device: str) -> float:
    """How far apart the sampling CDFs of logits a and b can lie at any token: the L1 distance of their
    filtered distributions, plus each one's float32 cumsum rounding on `device` (where the engine drew)."""
    probs = [filtered_probs(x.float().to(device)[None], [sp])[0] for x in (a, b)]
    rounding = [float((p.cumsum(0).double() - p.double().cumsum(0)).abs().max()) for p in probs]
    return float((probs[0].double() - probs[1].double()).abs().sum()) + sum(rounding)


def _flip_explained(ref: Run, run: Run, first: int, sp: SamplingParams, position: int, device: str) -> bool:
    """A draw may differ from the solo run's only where the two runs' logits at that step move the CDF
    across the request's own uniform: under the solo logits the batched token must lie within that shift
    of the uniform. (A draw from another uniform lands that close only by chance.)"""
    shift = _cdf_shift(ref.logits[first], run.logits[first], sp, device)
    return _drawn_by_own_uniform(ref.logits[first], run.tokens[first], sp, position, margin=shift)


def _sampled(eng, prompts, steps, tol, noise_of) -> pd.DataFrame:
    """Sampled requests (hot, so draws differ): each solo on slot 0, then all in one batch. Every batched token
    must be the one its own (seed, position) uniform selects from its logits, and equal the solo run's while
    the logits agree within tolerance, except where their difference explains a flipped draw (a near-boundary
    uniform: at a 152k vocabulary even float32 noise flips one draw in a few hundred)."""
    params = [SamplingParams(temperature=2.0, seed=1000 + i) for i in range(len(prompts))]
    solo = []
    for p, sp in zip(prompts, params, strict=True):
        eng.reset()
        solo.append(solo_run(eng, p, steps, slot=0, sampling=sp))
    _clear(eng)
    eng.allocate_batch_slots(len(prompts))
    reqs = [
        BatchedRequest(200 + i, list(p), sampling=sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
    ]
    logits = [[fr.logits.detach().float().cpu().clone()] for fr in eng.batch_prefill(reqs).results]
    for _ in range(steps):
        out = eng.batch_decode_step(reqs)
        for i in range(len(reqs)):
            logits[i].append(out.logits[i].detach().float().cpu().clone())
    rows = []
    for r, p, ref, lg in zip(reqs, prompts, solo, logits, strict=True):
        run, own = Run(list(r.generated_tokens), lg), noise_of(p, ref)
        own_draws = all(
            _drawn_by_own_uniform(x, t, r.sampling, len(p) + k)
            for k, (t, x) in enumerate(zip(run.tokens, lg, strict=True))
        )
        c = compare_runs(ref, run, tol, own)
        first = c["first_divergence"]
        explained = first < 0 or _flip_explained(ref, run, first, r.sampling, len(p) + first, eng.options.device)
        rows.append(
            dict(
                request_id=r.request_id,
                slot=r.slot_id,
                seed=r.sampling.seed,
                prompt_len=len(p),
                tokens_equal=c["tokens_equal"],
                first_divergence=first,
                flip_explained=explained,
                own_uniform_draws=own_draws,
                logits_within_tol=c["within_tol"],
                max_abs_diff=c["max_abs_diff"],
                **{"pass": bool(own_draws and c["within_tol"] and explained)},
            )
        )
    return pd.DataFrame(rows)


def _clear(eng) -> None:
    eng.allocate_batch_slots(eng.options.slot_count)
    for s in range(eng.num_slots):
        eng.release_slot(s)


def _batched(eng, prompts, steps, chunk):
    """Prefill all prompts in one call, decode `steps` times; record forwards and bookkeeping."""
    _clear(eng)
    n = len(prompts)
    eng.allocate_batch_slots(n)
    requests = [BatchedRequest(request_id=100 + i, prompt_tokens=list(p)) for i, p in enumerate(prompts)]
    book: list[tuple[str, Any, Any, bool]]  # (check, expected, actual, pass)
    forwards, book = [], [("allocate_batch_slots(n): slots in use", n, eng.num_slots, eng.num_slots == n)]

    def call(name, fn, expected):
        before = eng.forward_count
        out = fn(requests)
        forwards.append(
            dict(
                call=name,
                expected=expected,
                actual=eng.forward_count - before,
                **{"pass": eng.forward_count - before == expected},
            )
        )
        return out

    res = call("batch_prefill", eng.batch_prefill, math.ceil(max(map(len, prompts)) / chunk))
    logits = [[fr.logits.detach().float().cpu().clone()] for fr in res.results]
    book.append(
        (
            "batch_prefill allocates distinct slots 0..n-1",
            list(range(n)),
            sorted(cast(int, r.slot_id) for r in requests),  # batch_prefill gave every request a slot
            sorted(cast(int, r.slot_id) for r in requests) == list(range(n)),
        )
    )
    book.append(
        (
            "prefill positions == prompt lengths",
            [len(p) for p in prompts],
            [fr.position for fr in res.results],
            [fr.position for fr in res.results] == [len(p) for p in prompts],
        )
    )
    book.append(
        (
            "next_tokens == generated_tokens after prefill",
            res.next_tokens,
            [list(r.generated_tokens) for r in requests],
            all(r.generated_tokens == [t] for r, t in zip(requests, res.next_tokens, strict=True)),
        )
    )
    for k in range(steps):
        out = call(f"batch_decode_step {k + 1}", eng.batch_decode_step, 1)
        for i in range(n):
            logits[i].append(out.logits[i].detach().float().cpu().clone())
    want = [len(p) + steps for p in prompts]
    book.append(
        (
            "engine.position(slot) == prompt + decoded",
            want,
            [eng.position(r.slot_id) for r in requests],
            [eng.position(r.slot_id) for r in requests] == want,
        )
    )
    book.append(
        (
            "generated_tokens has 1 + steps tokens",
            [steps + 1] * n,
            [len(r.generated_tokens) for r in requests],
            all(len(r.generated_tokens) == steps + 1 for r in requests),
        )
    )
    book.append(
        (
            "last_token == generated_tokens[-1]",
            [r.generated_tokens[-1] for r in requests],
            [r.last_token for r in requests],
            all(r.last_token == r.generated_tokens[-1] for r in requests),
        )
    )
    return requests, logits, forwards, book


def _reuse_after_release(eng, requests, logits, solo, tol, noise):
    """Release the first request's slot, allocate it to a new request and prefill there alone; then one
    batch decode over everyone: the newcomer must match a fresh solo run, the others their solo runs."""
    first, others = requests[0], requests[1:]
    freed = first.slot_id
    eng.release_slot(freed)
    book: list[tuple[str, Any, Any, bool]] = [
        ("release_slot empties the slot", 0, eng.position(freed), eng.position(freed) == 0)
    ]
    got = eng.allocate_slot(request_id=999)
    book.append(("allocate_slot returns the freed slot", freed, got, got == freed))
    new = BatchedRequest(request_id=999, prompt_tokens=list(first.prompt_tokens), slot_id=got)
    fresh = Run()
    res = eng.batch_prefill([new]).results[0]
    fresh.add(res.next_token, res.logits)
    out = eng.batch_decode_step([new] + others)
    fresh.add(out.next_tokens[0], out.logits[0])
    ok_new = compare_runs(_prefix(solo[0], 2), fresh, tol, noise[0])["pass"]
    book.append(("re-used slot serves a new request like a fresh one", solo[0].tokens[:2], fresh.tokens, ok_new))
    ok = True
    for i, r in enumerate(others, start=1):
        run = Run(list(r.generated_tokens), logits[i] + [out.logits[i].detach().float().cpu()])
        ok &= compare_runs(_prefix(solo[i], len(run.tokens)), run, tol, noise[i])["pass"]
    want = [s.tokens[len(r.generated_tokens) - 1] for s, r in zip(solo[1:], others, strict=True)]
    book.append(("other slots continue unaffected", want, [r.generated_tokens[-1] for r in others], ok))
    return book


def _prefix(run: Run, n: int) -> Run:
    return Run(run.tokens[:n], run.logits[:n])


# -- error cases ---------------------------------------------------------------------------------
def _state(eng, requests) -> dict:
    """Everything a failed call must leave alone: every slot's snapshot, owners, allocation, requests."""
    slots = {}
    for s in range(eng.num_slots):
        snap = eng.snapshot(s)
        slots[s] = (list(snap.tokens), {k: v.clone() for k, v in snap.tensors.items()}, eng.cache.slots[s].owner)
    return dict(
        num_slots=eng.num_slots,
        slots=slots,
        forward_count=eng.forward_count,
        requests=[(r.slot_id, list(r.generated_tokens)) for r in requests],
    )


def _same(a: dict, b: dict) -> bool:
    if (a["num_slots"], a["requests"]) != (b["num_slots"], b["requests"]) or a["slots"].keys() != b["slots"].keys():
        return False
    for s, (toks, tensors, owner) in a["slots"].items():
        toks2, tensors2, owner2 = b["slots"][s]
        if toks != toks2 or owner != owner2 or tensors.keys() != tensors2.keys():
            return False
        if not all(torch.equal(tensors[k], tensors2[k]) for k in tensors):
            return False
    return True


def error_cases(eng, prompt: list[int], ref: Run, tol, noise: list[float] | None = None) -> pd.DataFrame:
    """Every misuse of the API on a busy engine: slot 0 mid-sequence, slot 1 full to max_seq_len,
    slot 2 allocated but empty, slot 3 outside the allocation. Each call must raise the expected
    exception and leave every slot (and the request objects) exactly as they were, with no forward run."""
    V, L = eng.cfg.vocab_size, eng.options.max_seq_len
    _clear(eng)
    eng.allocate_batch_slots(3)
    a, f, e = (eng.allocate_slot(request_id=i) for i in (1, 2, 3))
    ra = eng.prefill(prompt, slot_id=a)
    ra = eng.decode_step(ra.next_token, slot_id=a)
    rf = eng.prefill([(7 * i) % V for i in range(L)], slot_id=f)
    req_a = BatchedRequest(1, list(prompt), slot_id=a, generated_tokens=[ra.next_token])
    req_f = BatchedRequest(2, [], slot_id=f, generated_tokens=[rf.next_token])
    outside = 3
    R = BatchedRequest
    cases = [
        ("prefill: token >= vocab_size", ValueError, lambda: eng.prefill([1, V], slot_id=a)),
        ("prefill: negative token", ValueError, lambda: eng.prefill([3, -1], slot_id=a)),
        ("decode_step: token >= vocab_size", ValueError, lambda: eng.decode_step(V, slot_id=a)),
        ("decode_step: negative token", ValueError, lambda: eng.decode_step(-1, slot_id=a)),
        ("decode_step: non-integer token", ValueError, lambda: eng.decode_step(1.5, slot_id=a)),
        ("prefill: empty prompt", ValueError, lambda: eng.prefill([], slot_id=a)),
        ("batch_prefill: empty prompt", ValueError, lambda: eng.batch_prefill([R(9, [], slot_id=e)])),
        (
            "batch_prefill: bad token in 2nd request",
            ValueError,
            lambda: eng.batch_prefill([R(9, [1, 2], slot_id=a), R(10, [V], slot_id=e)]),
        ),
        ("prefill: slot outside allocation", IndexError, lambda: eng.prefill([1, 2], slot_id=outside)),
        ("decode_step: slot -1", IndexError, lambda: eng.decode_step(1, slot_id=-1)),
        (
            "batch_decode_step: slot outside allocation",
            IndexError,
            lambda: eng.batch_decode_step([req_a, R(9, [1], slot_id=outside, generated_tokens=[1])]),
        ),
        ("release_slot: slot outside allocation", IndexError, lambda: eng.release_slot(outside)),
        ("reset: slot outside allocation", IndexError, lambda: eng.reset(slot_id=outside)),
        ("snapshot: slot outside allocation", IndexError, lambda: eng.snapshot(outside)),
        ("decode_step before prefill", ValueError, lambda: eng.decode_step(1, slot_id=e)),
        (
            "batch_decode_step before batch_prefill",
            ValueError,
            lambda: eng.batch_decode_step([req_a, R(9, [1, 2], slot_id=e)]),
        ),
        ("prefill: prompt > max_seq_len", ValueError, lambda: eng.prefill([1] * (L + 1), slot_id=a)),
        ("decode_step: past max_seq_len", ValueError, lambda: eng.decode_step(rf.next_token, slot_id=f)),
        ("batch_decode_step: one slot past max_seq_len", ValueError, lambda: eng.batch_decode_step([req_a, req_f])),
        (
            "batch_prefill: duplicate slot",
            ValueError,
            lambda: eng.batch_prefill([R(9, [1, 2], slot_id=a), R(10, [3], slot_id=a)]),
        ),
        ("batch_decode_step: duplicate slot", ValueError, lambda: eng.batch_decode_step([req_a, req_a])),
        ("allocate_slot: all slots taken", ValueError, lambda: eng.allocate_slot(request_id=9)),
        ("batch_prefill: no free slot", ValueError, lambda: eng.batch_prefill([R(9, [1, 2])])),
        ("allocate_batch_slots(0)", ValueError, lambda: eng.allocate_batch_slots(0)),
        ("allocate_batch_slots(> max_slots)", ValueError, lambda: eng.allocate_batch_slots(eng.options.slot_count + 1)),
    ]
    rows = []
    for name, expected, fn in cases:
        before = _state(eng, [req_a, req_f])
        try:
            fn()
            raised, message = "(nothing)", ""
            ok_type = False
        except Exception as exc:  # noqa: BLE001 - recording whatever the engine raises is the point
            raised, message, ok_type = type(exc).__name__, str(exc), isinstance(exc, expected)
        after = _state(eng, [req_a, req_f])
        same = _same(before, after)
        rows.append(
            dict(
                case=name,
                expected=expected.__name__,
                raised=raised,
                message=message,
                state_unchanged=same,
                forwards_run=after["forward_count"] - before["forward_count"],
                **{"pass": ok_type and same and after["forward_count"] == before["forward_count"]},
            )
        )
    # and the busy slot still continues exactly as its solo run did
    try:
        r = eng.decode_step(ra.next_token, slot_id=a)
        m = step_metrics(
            ref.logits[2], r.logits, ref.tokens[2], r.next_token, tol, noise=cast("float | None", noise and noise[2])
        )
        ok = m["within_tol"] and not m["decisive_mismatch"]
        raised, message = "-", ""
    except Exception as exc:  # noqa: BLE001
        ok, raised, message = False, type(exc).__name__, str(exc)
    rows.append(
        dict(
            case="slot 0 continues like its solo run afterwards",
            expected="-",
            raised=raised,
            message=message,
            state_unchanged=ok,
            forwards_run=1,
            **{"pass": ok},
        )
    )
    return pd.DataFrame(rows)
