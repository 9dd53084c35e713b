"""Decode-step (or prefill) A/B of environment switches in ONE process: same engine, same weights, the graphs
captured again for each variant, the variants alternated round by round.

Why: the H200's step time drifts by a few percent between device calls (and within one), more than the effect of
most kernel changes; alternating variants in one process (odd rounds in reverse order) spreads that drift over all
of them alike, and each variant's step is also compared with the baseline's of the same round (paired ratios, and
in how many rounds it was the faster), which the drift between rounds does not reach.

    python -m pocketlab.tools.ab --model qwen3-30b-a3b --variants "POCKETLAB_PDL=1;POCKETLAB_PDL=0" [--rounds 5]
    python -m pocketlab.tools.ab --model qwen3.5-0.8b --variants ";linear_in_place_tokens=2048" --prefill 512
    python -m pocketlab.tools.ab --model qwen3-8b --variants ";POCKETLAB_ATTN_LAUNCH=0:4:2:0" --context 3000
    python -m pocketlab.tools.ab --summary-of reports/gpu/ab-*.txt   (the summary of tables saved by earlier runs)

A variant is comma-separated NAME=VALUE pairs: environment variables (set for its rounds, restored after, so only a
switch read as the kernels launch or the graphs are captured takes effect on the shared engine), and EngineOptions
fields, for which the variant gets an engine of its own over the same weights, built once before the rounds with
its environment switches set (so a switch read as the engine is built takes effect with any option beside it, e.g.
"POCKETLAB_X=1,warmup=False"; VALUE read as a Python literal). `tree=DIR` builds that engine from the
copy of the pocketlab package in DIR (an earlier revision: `git archive REV pocketlab | tar -x -C /tmp/rev`, then
tree=/tmp/rev/pocketlab), imported as a package of its own: a code change against the code before it, in one
process. The first variant is the baseline. After the timings, each variant's greedy decode from the same prompts
is held against the baseline's (`agreement`): a switch that is fast because it is wrong shows there.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd
from tqdm.auto import tqdm

from ..config import EngineOptions
from .bench import BenchConfig, device_name
from .bench_engine import build, engine_over
from .cli import ints, option
from .profile import decode_step, prefill_call
from .timing import Clock

if TYPE_CHECKING:
    from ..engine import QwenEngine

TREE = "tree"  # a variant's engine from another copy of the package
ENGINE_OPTIONS = {f.name for f in dataclasses.fields(EngineOptions)}
CONTEXT = BenchConfig.decode_prompt  # tokens a slot holds before the timed decode steps, as the bench's


def parse_variant(text: str) -> tuple[dict[str, str], dict[str, object]]:
    """'A=1,gemv_rows=0' -> ({'A': '1'}, {'gemv_rows': 0}): environment switches, and engine options (the names of
    EngineOptions fields, and `tree`: a directory, kept as text); '' is the environment and the engine as they are."""
    pairs = [kv.split("=", 1) for kv in text.split(",") if kv.strip()]
    if any(len(kv) != 2 or not kv[0].strip() for kv in pairs):
        raise ValueError(f"a variant is NAME=VALUE pairs separated by commas, got {text!r}")
    env: dict[str, str] = {}
    options: dict[str, object] = {}
    for k, v in ((k.strip(), v.strip()) for k, v in pairs):
        if k == TREE:
            options[k] = v
        elif k in ENGINE_OPTIONS:
            options[k] = option(f"{k}={v}")[1]
        else:
            env[k] = v
    return env, options


def median_call(engine, batch: int, steps: int, warm: int, prefill: int = 0, context: int = CONTEXT) -> float:
    """Seconds of the median of `steps` decode steps (graphed on CUDA; each from one call's return to the next's,
    Clock.calls) after `warm` untimed ones (graphs captured among those), from a fresh prefill of `context` tokens a
    slot, so every variant decodes the same positions; or with `prefill`, of that many tokens prefilled into slot 0
    from empty (its default checkpoints taken)."""
    clock = Clock(str(engine.options.device))
    if prefill:
        return clock.measure(prefill_call(engine, prefill), steps, warm, setup=lambda: engine.reset(0))
    step = decode_step(engine, batch, context)
    for _ in range(warm):
        step()
    return clock.pick(clock.calls(step, steps))


@contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """`env`'s switches set, restored after."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


@contextmanager
def under(engine: QwenEngine, variant: str) -> Iterator[None]:
    """The variant's environment switches set (restored after), the engine's graphs (if any) captured again under
    them."""
    with environment(parse_variant(variant)[0]):
        if engine.graphs is not None:  # its own package's class (a tree variant's engine is another copy's)
            engine.graphs = type(engine.graphs)(engine.model, engine.cache, engine.options)
        yield


def run(engines: dict[str, QwenEngine], variants: list[str], batch_sizes, rounds: int, steps: int, warm: int,
        prefill: int = 0, context: int = CONTEXT) -> pd.DataFrame:  # fmt: skip
    """One row per (batch, variant, round): the median graphed step (or prefill) of that round, in us, each variant
    on its engine (`engines[variant]`). Odd rounds run the variants in reverse order, so a drift that is linear in
    time weighs on every variant alike over each pair of rounds."""
    rows = []
    work = [(b, r, v) for b in batch_sizes for r in range(rounds) for v in (variants[:: -1 if r % 2 else 1])]
    for batch, rnd, variant in tqdm(work, desc="A/B rounds"):
        with under(engines[variant], variant):
            step_s = median_call(engines[variant], batch, steps, warm, prefill, context)
        rows.append({"batch": batch, "variant": variant or "(as is)", "round": rnd,
                     "step_us": step_s * 1e6})  # fmt: skip
    return pd.DataFrame(rows)


def agreement(engines: dict[str, QwenEngine], variants: list[str], batch: int, steps: int = 8,
              context: int = CONTEXT) -> pd.DataFrame:  # fmt: skip
    """Per variant, its greedy decode of `steps` steps from the same prompts (graphed where the engine graphs)
    against the first variant's: the first step's largest logit difference over the baseline's largest |logit|, and
    how many steps every row's token equals the baseline's before one differs. Reading the wrong rows shows at once;
    another summation order only as rounding, and as tokens that part after some steps (bf16, random weights)."""
    runs = {}
    for variant in variants:
        with under(engines[variant], variant):
            step = decode_step(engines[variant], batch, context)
            results = [step() for _ in range(steps)]
        runs[variant] = (results[0].logits.float(), [r.next_tokens for r in results])
    base_logits, base_tokens = runs[variants[0]]
    rows = []
    for variant, (logits, tokens) in runs.items():
        same = next((i for i, (a, b) in enumerate(zip(tokens, base_tokens, strict=True)) if a != b), steps)
        diff = (logits - base_logits).abs().max() / base_logits.abs().max()
        rows.append({"batch": batch, "variant": variant or "(as is)", "first_logits_rel_diff": diff.item(),
                     "same_tokens_steps": f"{same}/{steps}"})  # fmt: skip
    return pd.DataFrame(rows)


def engines_for(cfg: BenchConfig, variants: list[str]) -> dict[str, QwenEngine]:
    """variant -> its engine: one per distinct set of engine options (and package tree) with the variant's
    environment switches, set while it is built (for switches read then), all over the weights of one HF build."""
    hf, base = build(cfg)
    parsed = {v: parse_variant(v) for v in variants}
    keys = {v: own_engine_key(*parsed[v]) for v in variants}
    built: dict[tuple[tuple[str, object], ...], QwenEngine] = {(): base}
    for v, key in keys.items():
        if key not in built:
            env, options = parsed[v]
            package = load_tree(Path(str(options.pop(TREE)))) if TREE in options else None
            variant_cfg = dataclasses.replace(cfg, engine_options=dict(cfg.engine_options, **options))
            with environment(env):
                built[key] = engine_over(hf, variant_cfg, package)
    return {v: built[key] for v, key in keys.items()}


def own_engine_key(env: dict[str, str], options: dict[str, object]) -> tuple[tuple[str, object], ...]:
    """Which engine a variant runs on: the base engine, (), where it names no engine option; else its options and
    environment switches (an option at its default, such as warmup=False, gives a build-time switch an engine)."""
    return tuple(sorted(options.items())) + tuple(sorted(env.items())) if options else ()


def load_tree(path: Path):
    """The copy of the pocketlab package in directory `path`, imported under a name of its own (its modules import
    one another relatively), so its engine runs beside this one in one process."""
    if not (path / "__init__.py").is_file() or not (path / "engine.py").is_file():
        raise ValueError(f"tree={path}: not a copy of the pocketlab package (no __init__.py and engine.py there)")
    name = "pocketlab_tree_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:8]
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path / "__init__.py",
                                                      submodule_search_locations=[str(path)])  # fmt: skip
        assert spec is not None and spec.loader is not None
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def summary(df: pd.DataFrame, baseline: str) -> pd.DataFrame:
    """Per (batch, variant): median, min and max of the round medians, and the median against the baseline's; then
    paired, round by round against the baseline's step of the same round (the machine's drift between rounds cancels):
    the median, least and greatest of those ratios and in how many rounds the variant was the faster."""
    out = df.groupby(["batch", "variant"], sort=False).step_us.agg(["median", "min", "max"]).reset_index()
    base = out[out.variant == baseline].set_index("batch")["median"]
    out["vs_first"] = out["median"] / out.batch.map(base)
    rounds = df.merge(df[df.variant == baseline], on=["batch", "round"], how="left", suffixes=("", "_base"))
    paired = rounds.assign(ratio=rounds.step_us / rounds.step_us_base).groupby(["batch", "variant"], sort=False).ratio
    out["paired_median"] = paired.median().to_numpy()
    out["paired_min"], out["paired_max"] = paired.min().to_numpy(), paired.max().to_numpy()
    out["faster_rounds"] = [f"{(r < 1).sum()}/{len(r)}" for _, r in paired]
    return out


def printed(table: pd.DataFrame) -> str:
    return table.to_string(index=False, float_format=lambda x: f"{x:.3f}")


def rounds_of(text: str) -> pd.DataFrame:
    """The per-round table a run printed (its header line `variant ...`, then `batch round`, then one line per round)
    back as run()'s rows: so the paired summary can be read off tables saved before it existed."""
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("variant "))
    names = re.split(r"\s{2,}", lines[at].strip())[1:]
    rows, batch = [], None
    for line in lines[at + 2 :]:
        if not line.strip():
            break
        cells = line.split()
        if len(cells) == len(names) + 2:
            batch = int(cells.pop(0))
        rnd, values = int(cells[0]), cells[1:]
        rows += [
            {"batch": batch, "variant": n, "round": rnd, "step_us": float(v)}
            for n, v in zip(names, values, strict=True)
        ]
    return pd.DataFrame(rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m pocketlab.tools.ab", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--variants", help="';'-separated variants, each NAME=VALUE[,NAME=VALUE]")
    p.add_argument("--summary-of", nargs="+", default=(), metavar="FILE",
                   help="no run: the summary of the per-round tables saved in these files")  # fmt: skip
    p.add_argument("--batch-sizes", type=ints, default=(1,))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warm", type=int, default=5)
    p.add_argument("--prefill", type=int, default=0, help="N: time N-token prefills instead of decode steps")
    p.add_argument("--context", type=int, default=CONTEXT, help="decode steps after prompts of this many tokens")
    a = p.parse_args(argv)
    for path in a.summary_of:
        df = rounds_of(Path(path).read_text())
        print(f"{path}\n{printed(summary(df, df.variant.iloc[0]))}\n")
    if a.summary_of:
        return
    if not a.variants:
        p.error("--variants is needed for a run")
    variants = [v.strip() for v in a.variants.split(";")]
    for v in variants:
        parse_variant(v)
    cfg = BenchConfig(model=a.model, device=a.device, batch_sizes=a.batch_sizes, peer=False,
                      prompt_lens=(a.prefill,) if a.prefill else (), decode_prompt=a.context,
                      latency_batch_sizes=a.batch_sizes, latency_steps=0)  # fmt: skip
    engines = engines_for(cfg, variants)
    df = run(engines, variants, (1,) if a.prefill else a.batch_sizes, a.rounds, a.steps, a.warm, a.prefill, a.context)
    what = f"prefill of {a.prefill} tokens" if a.prefill else f"decode step after {a.context}-token prompts"
    print(f"\n{a.model} on {device_name(a.device)}: {what}, us (median of {a.steps} per round, {a.rounds} rounds)")
    rounds = df.pivot_table(index=["batch", "round"], columns="variant", values="step_us", sort=False)
    print(rounds.round(1).to_string())
    print("\n" + printed(summary(df, variants[0] or "(as is)")))
    if not a.prefill:
        agreeing = pd.concat([agreement(engines, variants, b, context=a.context) for b in a.batch_sizes])
        print(f"\nagainst the first variant's greedy decode:\n{agreeing.to_string(index=False)}")


if __name__ == "__main__":
    main()
