"""Slot isolation: a slot's output must not depend on what other slots do, or when.

Every sequence is first run solo (its slot alone, after a reset). Then all slots run together
under several schedules, and each sequence must reproduce its solo run: same tokens, logits
within tolerance. One schedule resets and one releases a slot mid-run; the others must carry on
unaffected, and the freed slot must then serve a new prompt as if it were fresh; a third
prefills a new prompt straight over a live slot; a fourth snapshots a slot mid-run, resets it and
restores it, and the slot must continue as if nothing happened.

In bf16/fp16 the bound is calibrated per step from the engine's own rounding noise (common.NoiseMeter:
a float32 engine re-runs each solo sequence), and a token may differ only where that noise explains it.
"""

from __future__ import annotations

import pandas as pd

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
    tolerance,
)

VICTIM = 0  # the slot reset/released mid-run: slot 0, the default slot, is where shared state would hide
SCHEDULES = (
    "interleaved",
    "staggered",
    "sequential",
    "reset_mid_run",
    "release_mid_run",
    "overwrite_mid_run",
    "snapshot_restore",
)


def default_prompt_lens(num_slots: int) -> list[int]:
    return [4 + 5 * i for i in range(num_slots)]


def schedule(name: str, n: int, steps: int, victim: int = VICTIM) -> list[tuple]:
    """Events: ("op", key, slot) advances sequence `key` by one op (prefill first, then decode);
    ("reset"|"release"|"snapshot"|"restore", slot); ("allocate", request_id, expected_slot). Key "s<i>" is
    slot i's prompt, key "new" the prompt the victim slot serves after it was freed."""
    ops = steps + 1
    if name == "snapshot_restore":  # the victim's state taken out and put back mid-run: it must go on unchanged
        half = ops // 2
        events: list[tuple] = [("op", f"s{s}", s) for _ in range(half) for s in range(n)]
        events += [("snapshot", victim), ("reset", victim), ("restore", victim)]
        return events + [("op", f"s{s}", s) for _ in range(ops - half) for s in range(n)]
    if name == "interleaved":
        return [("op", f"s{s}", s) for _ in range(ops) for s in range(n)]
    if name == "staggered":  # slot s joins s rounds late, in reverse order: prefills land between decodes
        return [("op", f"s{s}", s) for r in range(ops + n - 1) for s in reversed(range(n)) if 0 <= r - s < ops]
    if name == "sequential":
        return [("op", f"s{s}", s) for s in range(n) for _ in range(ops)]
    if name.endswith("mid_run"):
        half = ops // 2
        events = [("allocate", 100 + s, s) for s in range(n)] if name == "release_mid_run" else []
        events += [("op", f"s{s}", s) for _ in range(half) for s in range(n)]
        if name == "reset_mid_run":
            events.append(("reset", victim))
        elif name == "release_mid_run":
            events += [("release", victim), ("allocate", 200, victim)]
        # overwrite_mid_run: the new prompt is simply prefilled over the victim's live sequence
        for r in range(ops):
            events += [("op", f"s{s}", s) for s in range(n) if s != victim and half + r < ops]
            events.append(("op", "new", victim))
        return events
    raise ValueError(f"unknown schedule {name!r}; known: {SCHEDULES}")


def play(eng, events: list[tuple], prompts: dict[str, list[int]]) -> dict[str, Run]:
    """Run the events on a cleared engine; a freed slot's unfinished run is kept as it stood."""
    for s in range(eng.num_slots):
        eng.release_slot(s)
    runs: dict[str, Run] = {}
    snaps = {}
    for ev in events:
        if ev[0] == "op":
            _, key, slot = ev
            run = runs.setdefault(key, Run())
            r = (
                eng.prefill(prompts[key], slot_id=slot)
                if not run.tokens
                else eng.decode_step(run.tokens[-1], slot_id=slot)
            )
            run.add(r.next_token, r.logits)
        elif ev[0] == "reset":
            eng.reset(slot_id=ev[1])
        elif ev[0] == "release":
            eng.release_slot(ev[1])
        elif ev[0] == "snapshot":
            snaps[ev[1]] = eng.snapshot(ev[1])
        elif ev[0] == "restore":
            eng.restore(snaps[ev[1]], ev[1])
        elif ev[0] == "allocate":
            got = eng.allocate_slot(request_id=ev[1])
            if got != ev[2]:
                raise AssertionError(f"allocate_slot gave slot {got}, expected the free slot {ev[2]}")
    return runs


@single_thread_on_cpu
def isolation(
    model="tiny-qwen3",
    device: str = "cpu",
    dtype: str = "float32",
    seed: int = 0,
    num_slots=2,
    prompt_lens=None,
    decode_steps: int = 8,
    prefill_chunk: int = 8,
) -> Report:
    """`num_slots` may be a list (e.g. [2, 4]): each count is checked. Table: one row per
    (slot count, schedule, sequence); summary: one row per (slot count, schedule)."""
    pair = as_pair(model, device, dtype, seed)
    dtype = pair.dtype
    tol = tolerance(dtype)
    rows = []
    for n in [num_slots] if isinstance(num_slots, int) else list(num_slots):
        lens = list(prompt_lens or default_prompt_lens(n))[:n]
        if len(lens) < n:
            raise ValueError(f"need {n} prompt lengths, got {lens}")
        texts = random_prompts(pair.vocab_size, lens + [6], seed + n)
        prompts = {f"s{s}": texts[s] for s in range(n)} | {"new": texts[n]}
        slot_of = {f"s{s}": s for s in range(n)} | {"new": VICTIM}
        opts = dict(max_slots=n, max_seq_len=seq_len_for(lens + [6], decode_steps), prefill_chunk=prefill_chunk)
        eng, noise_of = pair.engine(**opts), NoiseMeter(pair, **opts)
        solo, noise = {}, {}
        for key, prompt in prompts.items():
            eng.reset()
            solo[key] = solo_run(eng, prompt, decode_steps, slot=slot_of[key])
            noise[key] = noise_of(prompt, solo[key])
        for name in SCHEDULES:
            try:
                runs = play(eng, schedule(name, n, decode_steps), prompts)
                error = ""
            except Exception as e:  # a crash is a failed check, not a crashed notebook
                runs, error = {}, f"{type(e).__name__}: {e}"
            for key in prompts:
                if key == "new" and not name.endswith("mid_run"):
                    continue
                ref, own = solo[key], noise[key]
                run = runs.get(key, Run())
                if name.endswith("mid_run") and key == f"s{VICTIM}":  # the victim: compare what it ran
                    ref = Run(ref.tokens[: len(run.tokens)], ref.logits[: len(run.tokens)])  # up to its reset
                c = (
                    compare_runs(ref, run, tol, own)
                    if run.tokens
                    else dict(
                        steps=0,
                        tokens_equal=False,
                        token_agreement=0.0,
                        first_divergence=0,
                        max_abs_diff=float("nan"),
                        bound=tol.atol,
                        bitwise=False,
                        **{"pass": False},
                    )
                )
                rows.append(
                    dict(
                        num_slots=n,
                        schedule=name,
                        sequence=key,
                        slot=slot_of[key],
                        prompt_len=len(prompts[key]),
                        **c,
                        error=error,
                    )
                )
    table = pd.DataFrame(rows)
    summary = (
        table.groupby(["num_slots", "schedule"], sort=False)
        .agg(
            sequences=("sequence", "size"),
            tokens_equal=("tokens_equal", "all"),
            token_agreement=("token_agreement", "min"),
            max_abs_diff=("max_abs_diff", "max"),
            bitwise=("bitwise", "all"),
            error=("error", "first"),
            **{"pass": ("pass", "all")},
        )
        .reset_index()
    )
    summary.insert(summary.columns.get_loc("error"), "tolerance", tol.describe(calibrated=True))
    figures = dict(
        model=pair.name,
        dtype=dtype,
        slot_counts=",".join(map(str, summary.num_slots.unique())),
        schedules=len(SCHEDULES),
        max_abs_diff_vs_solo=float(table.max_abs_diff.max()),
        min_token_agreement=float(table.token_agreement.min()),
        bitwise=bool(table.bitwise.all()),
    )
    return Report("isolation", summary, {"sequences": table}, figures)
