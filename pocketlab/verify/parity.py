"""Single-session parity: the engine's logits and greedy tokens against HF transformers, per step.

HF sees the engine's whole token sequence (prompt + generated) in one forward, so every step is
compared on identical inputs. Prompt lengths straddle the prefill chunk, where chunking bugs hide.
The reference is HF in float32; in bf16/fp16 HF is also run in that dtype, and its own distance
from float32 calibrates how far the engine may be (see common.Tolerance).
"""

from __future__ import annotations

import pandas as pd
import torch

from .common import (
    Report,
    as_pair,
    hf_logits,
    random_prompts,
    seq_len_for,
    single_thread_on_cpu,
    solo_run,
    step_metrics,
    tolerance,
)


def default_prompt_lens(prefill_chunk: int) -> list[int]:
    """1, just below, at and just above the chunk, and a few chunks long."""
    return sorted({1, max(1, prefill_chunk - 1), prefill_chunk, prefill_chunk + 1, 2 * prefill_chunk + 5})


@single_thread_on_cpu
def parity(
    model="tiny-qwen3",
    device: str = "cpu",
    dtype: str = "float32",
    seed: int = 0,
    prompt_lens=None,
    decode_steps: int = 8,
    prefill_chunk: int = 8,
) -> Report:
    """Per-step table (`tables['steps']`) and per-prompt summary with a boolean `pass` column."""
    pair = as_pair(model, device, dtype, seed)
    dtype = pair.dtype
    tol = tolerance(dtype)
    lens = list(prompt_lens or default_prompt_lens(prefill_chunk))
    eng = pair.engine(max_slots=2, max_seq_len=seq_len_for(lens, decode_steps), prefill_chunk=prefill_chunk)
    rows, summary = [], []
    for length, prompt in zip(lens, random_prompts(pair.vocab_size, lens, seed), strict=True):
        eng.reset()
        run = solo_run(eng, prompt, decode_steps)  # the default slot
        eng.reset()
        explicit = solo_run(eng, prompt, decode_steps, slot=0)
        seq = prompt + run.tokens[:-1]
        ref = hf_logits(pair.hf32, seq)[length - 1 :]
        hf_err = [None] * len(ref)
        if dtype != "float32":
            hf_err = (hf_logits(pair.hf, seq)[length - 1 :] - ref).abs().amax(dim=-1).tolist()
        steps = []
        for k in range(len(run.tokens)):
            m = step_metrics(ref[k], run.logits[k], int(ref[k].argmax()), run.tokens[k], tol, hf_err[k])
            m["hf_own_diff"] = hf_err[k] if hf_err[k] is not None else float("nan")
            m["explicit_slot_equal"] = run.tokens[k] == explicit.tokens[k] and torch.equal(
                run.logits[k], explicit.logits[k]
            )
            steps.append(dict(prompt_len=length, step=k, position=length + k, **m))
        rows += steps
        df = pd.DataFrame(steps)
        mismatch = df.index[~df.token_equal]
        summary.append(
            dict(
                prompt_len=length,
                steps=len(df),
                max_abs_diff=df.max_abs_diff.max(),
                max_rel_diff=df.rel_diff.max(),
                hf_own_diff=df.hf_own_diff.max(),
                tolerance=tol.describe(vs_hf=True),
                token_agreement=df.token_equal.mean(),
                first_divergence=int(mismatch[0]) if len(mismatch) else -1,
                decisive_mismatches=int(df.decisive_mismatch.sum()),
                default_eq_explicit=bool(df.explicit_slot_equal.all()),
                **{
                    "pass": bool(
                        df.within_tol.all() and not df.decisive_mismatch.any() and df.explicit_slot_equal.all()
                    )
                },
            )
        )
    table, summary = pd.DataFrame(rows), pd.DataFrame(summary)
    figures = dict(
        model=pair.name,
        dtype=dtype,
        max_abs_diff=float(table.max_abs_diff.max()),
        max_rel_diff=float(table.rel_diff.max()),
        token_agreement=float(table.token_equal.mean()),
        tolerance=tol.describe(vs_hf=True),
    )
    if dtype != "float32":
        figures["hf_own_diff"] = float(table.hf_own_diff.max())
    return Report("parity", summary, {"steps": table}, figures)
