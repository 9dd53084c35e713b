"""The HF peer: transformers' own `generate` on the same weights, timed step by step."""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING

import numpy as np
import torch
import transformers
from transformers.generation.streamers import BaseStreamer

from .timing import Clock

if TYPE_CHECKING:
    from .bench import BenchConfig


class StepStamps(BaseStreamer):
    """Host time at each `put`. HF copies every new token to the host before handing it over (a device
    sync), so the gap between two stamps is one whole step of HF's generate loop, as it runs."""

    def __init__(self):
        self.stamps: list[float] = []

    def put(self, value) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass

    def decode_steps(self) -> list[float]:
        """The first put is the prompt and the second follows the prefill; every later gap is a decode step."""
        return np.diff(self.stamps)[1:].tolist()


def bench_peer(
    hf, clock: Clock, mode: str, batch: int, new_tokens: int, cfg: BenchConfig, gen: torch.Generator
) -> dict:
    """HF `generate` on the same weights, greedy, fixed length (min_new_tokens = max_new_tokens).

    Decode speed comes from per-step stamps (the quantile of the step samples, as for pocketlab), so it
    needs no prefill correction and a shared CPU cannot skew it. Cross-check in `tokens_per_s_subtract`:
    (N - 1) steps over t(generate N new) - t(generate 1 new), which cancels the prefill and generate's
    fixed setup. With the static cache on CUDA, HF compiles the decode step; the untimed warm-up pays it.
    """
    ids = torch.randint(0, hf.config.vocab_size, (batch, cfg.decode_prompt), generator=gen).to(cfg.device)
    mask = torch.ones_like(ids)
    cache = "static" if mode == "static" else None

    def generate(n: int, streamer=None):
        gc = transformers.GenerationConfig(
            do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0, cache_implementation=cache
        )
        out = hf.generate(ids, attention_mask=mask, generation_config=gc, streamer=streamer)
        if out.shape[1] != cfg.decode_prompt + n:
            raise RuntimeError(f"HF generate made {out.shape[1] - cfg.decode_prompt} tokens, asked for {n}")

    generate(new_tokens if mode == "static" else min(new_tokens, 4))  # warm-up; the static one compiles
    steps, full = [], []
    for _ in range(cfg.peer_repeats):
        stamps = StepStamps()
        full.append(clock.time(functools.partial(generate, new_tokens, stamps)))
        steps += stamps.decode_steps()
    one = clock.measure(lambda: generate(1), cfg.peer_repeats, warmup=1)
    step = clock.pick(steps)
    return {
        "mode": mode,
        "batch": batch,
        "new_tokens": new_tokens,
        "compiled": mode == "static" and clock.cuda,
        "seconds_full": clock.pick(full),
        "seconds_one": one,
        "step_s": step,
        "step_p90_s": float(np.quantile(steps, 0.9)),
        "tokens_per_s": batch / step,
        "tokens_per_s_subtract": batch * (new_tokens - 1) / max(clock.pick(full) - one, 1e-9),
    }
