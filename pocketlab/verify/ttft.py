"""Time to first token with the prefix cache: a prompt whose prefix is cached (same slot, another slot, a
released slot) against the same prompt cold.

    from pocketlab.verify.ttft import ttft
    ttft(model="qwen3-8b", device="cuda", dtype="bfloat16")
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import pandas as pd

from ..tools.timing import Clock
from .common import as_pair, random_prompts, single_thread_on_cpu

if TYPE_CHECKING:
    from ..requests import ForwardResult


def _cache_prefix(eng, prefix: list[int], cached_in) -> None:
    """A fresh engine, then (cached_in 0 or "released") `prefix` prefilled in slot 0, released for "released"."""
    eng.reset()
    if cached_in is not None:
        eng.prefill(prefix, slot_id=0)
        if cached_in == "released":
            eng.release_slot(0)


def _prefill_into(result: dict[str, ForwardResult], eng, prompt: list[int], slot: int) -> None:
    result["r"] = eng.prefill(prompt, slot_id=slot)


@single_thread_on_cpu
def ttft(
    model="qwen3-8b",
    device: str = "cuda",
    dtype: str = "bfloat16",
    seed: int = 0,
    prompt_len: int = 4096,
    cached_len: int = 3968,
    repeats: int = 5,
    warmup: int = 1,
    checkpoint_stride: int | None = None,
    prefill_chunk: int | None = None,
) -> pd.DataFrame:
    """Time to first token of a `prompt_len`-token prompt whose first `cached_len` tokens are cached (prefilled
    earlier as a prompt of their own) against the same prompt cold. CUDA events on a GPU, perf_counter on CPU.
    Rows: cold (cache off), cold (cache on, a miss: lookup + checkpoints), hit in the same slot (the prefix was
    this slot's prompt), hit in another slot (device copy of K/V and state), hit from a released slot."""
    if not 0 < cached_len < prompt_len:
        raise ValueError(f"need 0 < cached_len={cached_len} < prompt_len={prompt_len}")
    pair = as_pair(model, device, dtype, seed)
    name = pair.name
    opts = dict(max_slots=2, max_seq_len=prompt_len + 8, cuda_graphs=False)
    if checkpoint_stride is not None:
        opts["checkpoint_stride"] = checkpoint_stride
    if prefill_chunk is not None:
        opts["prefill_chunk"] = prefill_chunk
    prompt = random_prompts(pair.vocab_size, [prompt_len], seed + 21)[0]
    prefix = prompt[:cached_len]
    clock = Clock(device)
    rows = []
    engines = {"off": pair.engine(**opts, prefix_cache=False), "on": pair.engine(**opts)}
    del pair
    modes = {
        "cold, cache off": ("off", None, 0),
        "cold, cache on (miss)": ("on", None, 0),
        "hit: same slot": ("on", 0, 0),
        "hit: other slot (copy)": ("on", 0, 1),
        "hit: released slot": ("on", "released", 1),
    }
    for mode, (which, cached_in, slot) in modes.items():
        result: dict[str, ForwardResult]
        eng, result = engines[which], {}
        setup = functools.partial(_cache_prefix, eng, prefix, cached_in)
        call = functools.partial(_prefill_into, result, eng, prompt, slot)
        samples = []
        for k in range(warmup + repeats):
            t = clock.time(call, setup=setup)
            if k >= warmup:
                samples.append(t)
        r = result["r"]
        rows.append(
            dict(
                model=name,
                device=device,
                dtype=dtype,
                mode=mode,
                prompt_len=prompt_len,
                cached_len=cached_len if cached_in is not None else 0,
                reused=r.reused_tokens,
                computed=r.computed_tokens,
                ttft_ms=1e3 * clock.pick(samples),
                min_ms=1e3 * min(samples),
                repeats=repeats,
            )
        )
    df = pd.DataFrame(rows)
    df["speedup_vs_cold"] = df.ttft_ms[df["mode"] == "cold, cache off"].iloc[0] / df.ttft_ms
    return df
