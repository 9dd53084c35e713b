"""What MTP speculative decoding costs on a device: verify step against plain step, oracle tokens/s, and the
acceptance rate at which it breaks even."""

from __future__ import annotations

import functools

import pandas as pd
import torch

from ..engine import QwenEngine
from ..requests import BatchedRequest
from ..tools.timing import Clock
from .common import single_thread_on_cpu
from .mtp_runs import mtp_engine, plain, use_drafter


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
    make, vocab = mtp_engine(model, device, dtype, seed)
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
