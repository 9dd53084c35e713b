"""Perf regression: ratios measured in one run, judged against a stored baseline (fail if > 5% worse).

Absolute timings drift between machines and runs; ratios against figures measured alongside them (the
HF peer on the same weights, the matmul rate, the copy bandwidth) do not, so those are what we store
and judge. Every judged figure is higher-is-better.

    python -m pocketlab.verify.perf --device cpu --dtype float32 --model tiny-qwen3            # check
    python -m pocketlab.verify.perf --write-baseline --device cpu --dtype float32 --model tiny-qwen3

On a shared CPU the check runs the bench in several rounds (one thread, low-quantile step times) and judges
each ratio to HF from the two sides' best rates over the rounds (the median over rounds for other figures); on a
GPU one round with medians is steady.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pandas as pd

from ..tools import bench, bench_tables
from .common import Report

TOLERANCE = 0.05
BASELINE_DIR = Path(__file__).resolve().parents[2] / "reports" / "baseline"  # notebooks run from notebooks/
BENCH_DIR_ENV = "POCKETLAB_BENCH_DIR"  # reuse a bench JSON from the same GPU run instead of measuring again

# What the check measures, per device kind. CPU: tiny and fast (nbval runs it), many samples, one thread.
# On the CPU only the ratios to the HF peer are judged: a tiny model's step is pure Python overhead, the DRAM
# copy rate on a shared machine swings by 20% with the neighbours' traffic, and prefill against the matmul
# calibration moved by up to 17% between back-to-back runs. Roofline and prefill are still shown. Even the
# ratios moved by up to 8% between back-to-back runs of the tiny hybrid here, so the CPU tolerance is 15%;
# the GPU keeps the 5% the perf contract asks for. One round's b16 ratio at tiny-qwen3 ranged 0.79-1.36 on
# 2026-12-03 (baseline 1.20) and the median of five rounds 0.90-1.18, once past the tolerance: nine rounds. The
# median of nine still fell to 0.92 once (rounds 0.91-1.63): noise on a shared CPU only ever slows a side, and the
# two sides are timed apart, so each round's ratio swings; each side's best rate over the rounds does not.
SETTINGS = {
    "cpu": dict(
        batch_sizes=(1, 4, 16),
        prompt_lens=(64, 256),
        new_tokens=32,
        repeats=30,
        decode_repeats=3,
        peer_modes=("eager",),
        peer_batch_sizes=None,
        threads=1,
        quantile=0.1,
        rounds=9,
        kinds=("vs_hf",),
        tolerance=0.15,
        latency_steps=200,
        latency_batch_sizes=(1, 4),
        serving_requests=12,
        serving_prompt=(8, 64),
        serving_new=(16, 48),
    ),
    "cuda": dict(
        batch_sizes=(1, 4, 16, 32, 64),
        prompt_lens=(512, 4096),
        new_tokens=128,
        repeats=3,
        peer_modes=("eager", "static"),
        peer_batch_sizes=(1, 32),
        peer_eager_new_tokens=32,
        peer_repeats=2,
        threads=0,
        quantile=0.5,
        rounds=1,
        kinds=("vs_hf", "roofline", "prefill"),
        tolerance=TOLERANCE,
    ),
}


def settings(device: str, **overrides) -> dict:
    """The device's defaults with any non-None overrides."""
    s = dict(SETTINGS["cuda" if device.startswith("cuda") else "cpu"])
    s.update({k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items() if v is not None})
    s["peer_batch_sizes"] = s["peer_batch_sizes"] or s["batch_sizes"]  # CPU: the peer at every batch size
    return s


# -- measuring ---------------------------------------------------------------------------------
def measure(
    model: str = "tiny-qwen3", device: str = "cpu", dtype: str = "", seed: int = 0, progress: bool = False, **overrides
) -> list[dict]:
    """Bench results, one per round. Overrides: any BenchConfig field, `rounds`, `kinds` (ignored here).

    If $POCKETLAB_BENCH_DIR holds <device>-<model>.json for the same dtype, that run is used instead
    (the GPU script benches first, then renders the reports from the same figures).
    """
    s = settings(device, **overrides)
    rounds = s.pop("rounds")
    s.pop("kinds"), s.pop("tolerance")
    reused = reuse_bench(model, device, dtype)
    if reused is not None:
        return [reused]
    cfg = dict(model=model, device=device, dtype=dtype, seed=seed, progress=progress, **s)
    first = bench.run(bench.BenchConfig(**cfg))  # later rounds repeat only the judged sections
    later = dict(cfg, skip=tuple(cfg.get("skip", ())) + ("latency", "serving"))
    return [first] + [bench.run(bench.BenchConfig(**later)) for _ in range(rounds - 1)]


def reuse_bench(model: str, device: str, dtype: str) -> dict | None:
    folder = os.environ.get(BENCH_DIR_ENV)
    if not folder:
        return None
    path = Path(folder) / f"{device.split(':')[0]}-{model}.json"
    if not path.is_file():
        return None
    result = json.loads(path.read_text())
    result["meta"]["source"] = str(path)
    if dtype and result["meta"]["config"]["dtype"] != dtype:
        raise ValueError(f"{path} was measured in {result['meta']['config']['dtype']}, not {dtype}")
    return result


def figures(result: dict, kinds=("vs_hf", "roofline", "prefill")) -> dict[str, float]:
    """The judged figures of one run: all ratios within that run, all higher-is-better."""
    out: dict[str, float] = {}
    if "vs_hf" in kinds:
        out |= {k: v for k, v in result["ratios"].items() if k.startswith("pocketlab_over_hf_")}
    if "roofline" in kinds:
        out |= {f"roofline_frac_b{d['batch']}": d["roofline_frac"] for d in result["decode"]}
    if "prefill" in kinds:
        out |= {f"prefill_{p['kind']}_{p['prompt_len']}_of_matmul": p["matmul_frac"] for p in result["prefill"]}
    return out


def rounds_table(results: list[dict], kinds) -> pd.DataFrame:
    """Each figure per round, the median over rounds, and the value that is judged: for a ratio to HF, our best
    rate over the rounds over HF's best (`best_rates_ratios`), else the median."""
    df = pd.DataFrame([figures(r, kinds) for r in results]).T
    df.columns = [f"round {i}" for i in range(len(results))]
    df["median"] = df.median(axis=1)
    best = best_rates_ratios(results)
    df["judged"] = [best.get(name, median) for name, median in df["median"].items()]
    df.index.name = "figure"
    return df


def best_rates_ratios(results: list[dict]) -> dict[str, float]:
    """pocketlab_over_hf_<mode>_b<batch> by tools.bench.ratios over each side's fastest round per batch (and peer
    mode): one round gives the bench's own ratios."""

    def fastest(rows: list[dict], key) -> list[dict]:
        best: dict = {}
        for row in rows:
            if "error" not in row and (key(row) not in best or row["tokens_per_s"] > best[key(row)]["tokens_per_s"]):
                best[key(row)] = row
        return list(best.values())

    decode = fastest([d for r in results for d in r["decode"]], lambda d: d["batch"])
    peer = fastest([p for r in results for p in r["peer"]], lambda p: (p["mode"], p["batch"]))
    ratios = bench.ratios({"decode": decode, "peer": peer})
    return {k: v for k, v in ratios.items() if k.startswith("pocketlab_over_hf_")}


# -- baseline ----------------------------------------------------------------------------------
def baseline_path(device: str, model: str) -> Path:
    return BASELINE_DIR / f"{device.split(':')[0]}-{model}.json"


def write_baseline(results: list[dict], kinds, path: Path) -> Path:
    """Store the judged figures (rounds_table's), the settings and the raw first round."""
    table = rounds_table(results, kinds)
    meta = results[0]["meta"]
    device = meta["config"]["device"]
    doc = {
        "model": meta["config"]["model"],
        "device": device,
        "dtype": meta["config"]["dtype"],
        "kinds": list(kinds),
        "tolerance": settings(device)["tolerance"],
        "figures": table["judged"].to_dict(),
        "rounds": len(results),
        "meta": meta,
        "raw": results[0],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=str))
    return path


def compare(current: dict[str, float], baseline: dict, tolerance: float = TOLERANCE) -> pd.DataFrame:
    """One row per baseline figure: passes unless the figure is missing or more than `tolerance` worse.

    Figures new in this run are listed but not judged (refresh the baseline to start judging them).
    """
    rows = []
    for name, base in baseline["figures"].items():
        now = current.get(name)
        if now is None:
            rows.append(
                {
                    "figure": name,
                    "baseline": base,
                    "current": None,
                    "change": None,
                    "status": "missing in this run",
                    "pass": False,
                }
            )
            continue
        change = now / base - 1
        ok = change >= -tolerance
        rows.append(
            {
                "figure": name,
                "baseline": base,
                "current": now,
                "change": change,
                "status": "ok" if ok else f"worse by more than {tolerance:.0%}",
                "pass": ok,
            }
        )
    for name in sorted(set(current) - set(baseline["figures"])):
        rows.append(
            {
                "figure": name,
                "baseline": None,
                "current": current[name],
                "change": None,
                "status": "new (not judged)",
                "pass": True,
            }
        )
    return pd.DataFrame(rows, columns=["figure", "baseline", "current", "change", "status", "pass"])


def enforced(flag: bool | None = None) -> bool:
    """None: enforce the baseline everywhere except shared CI machines (CI=true), where noise is not regression."""
    return flag if flag is not None else os.environ.get("CI") != "true"


def verdict(table: pd.DataFrame) -> bool:
    return bool(len(table)) and bool(table["pass"].all())


def check(results: list[dict], path: Path | None = None) -> tuple[pd.DataFrame, bool]:
    """Compare a measurement against its stored baseline: (table, verdict)."""
    meta = results[0]["meta"]["config"]
    path = _baseline_file(results, path)
    if not path.is_file():
        raise FileNotFoundError(
            f"no perf baseline {path}: write one with `python -m pocketlab.verify.perf "
            f"--write-baseline --device {meta['device']} --dtype {meta['dtype']} "
            f"--model {meta['model']}`"
        )
    baseline = json.loads(path.read_text())
    if baseline["dtype"] != meta["dtype"]:
        raise ValueError(f"baseline {path} is {baseline['dtype']}, this run is {meta['dtype']}")
    current = rounds_table(results, baseline["kinds"])["judged"].to_dict()
    table = compare(current, baseline, baseline.get("tolerance", TOLERANCE))
    return table, verdict(table)


# -- the notebook's entry point ----------------------------------------------------------------
def perf(
    model: str = "tiny-qwen3",
    device: str = "cpu",
    dtype: str = "",
    seed: int = 0,
    batch_sizes=None,
    prompt_lens=None,
    repeats=None,
    rounds=None,
    baseline: Path | None = None,
    **overrides,
) -> Report:
    """Measure (or reuse the GPU run's bench JSON), compare with the baseline, and package it all.

    summary: the baseline comparison (column `pass`); tables: ceilings, decode, prefill, peer, rounds,
    curves (decode tokens/s by batch), roofline; figures: the key numbers for the reports index.
    """
    results = measure(
        model,
        device,
        dtype,
        seed,
        batch_sizes=batch_sizes,
        prompt_lens=prompt_lens,
        repeats=repeats,
        rounds=rounds,
        **overrides,
    )
    summary, _ = check(results, baseline)
    t = tables(results)
    kinds = json.loads(_baseline_file(results, baseline).read_text())["kinds"]
    t |= {"rounds": rounds_table(results, kinds), "curves": decode_curves(results), "roofline": roofline(results)}
    t["latency_ms"] = latency_samples(results)
    first = results[0]
    figs = {
        "source": first["meta"].get("source", "measured now"),
        "rounds": len(results),
        "copy_GBps": first["ceilings"]["copy"]["bytes_per_s"] / 1e9,
        "matmul_TFLOPs": first["ceilings"]["matmul"]["flop_per_s"] / 1e12,
        **{f"decode_tok_s_b{d['batch']}": d["tokens_per_s"] for d in first["decode"]},
        **t["rounds"]["judged"].to_dict(),
        **{k: v for k, v in first["ratios"].items() if k.startswith(("latency_", "serving_"))},
    }
    return Report("perf", summary, t, figs)


def _baseline_file(results: list[dict], path: Path | None) -> Path:
    meta = results[0]["meta"]["config"]
    return path or baseline_path(meta["device"], meta["model"])


# -- display helpers for the notebook ------------------------------------------------------------
def tables(results: list[dict]) -> dict[str, pd.DataFrame]:
    """bench_tables.tables of the first round (the rounds differ only by noise)."""
    return bench_tables.tables(results[0])


def decode_curves(results: list[dict]) -> pd.DataFrame:
    """Decode tokens/s by batch size: pocketlab and each HF peer, one column each (for plotting)."""
    r = results[0]
    df = pd.DataFrame({"pocketlab": {d["batch"]: d["tokens_per_s"] for d in r["decode"]}})
    for p in r["peer"]:
        if "error" not in p:
            df.loc[p["batch"], f"HF {p['mode']}"] = p["tokens_per_s"]
    df.index.name = "batch"
    return df.sort_index()


def latency_samples(results: list[dict]) -> pd.DataFrame:
    """Every timed decode step of the latency runs, in ms, one column per batch size (for the histogram/CDF)."""
    runs = results[0].get("latency", [])
    return pd.DataFrame({f"batch {d['batch']}": pd.Series(d["samples_s"]) * 1e3 for d in runs})


def roofline(results: list[dict]) -> pd.DataFrame:
    r = results[0]
    return pd.DataFrame(
        [
            {
                "batch": d["batch"],
                "step ms": d["step_s"] * 1e3,
                "roofline ms": d["roofline_step_s"] * 1e3,
                "roofline frac": d["roofline_frac"],
                "weight MB": d["weight_bytes"] / 1e6,
                "KV MB": d["kv_bytes"] / 1e6,
                "state MB": d["state_bytes"] / 1e6,
            }
            for d in r["decode"]
        ]
    )


# -- CLI ---------------------------------------------------------------------------------------
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pocketlab.verify.perf", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny-qwen3")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--write-baseline", action="store_true", help="measure and (over)write the baseline")
    p.add_argument("--from-bench", type=Path, default=None, help="use this bench JSON instead of measuring")
    p.add_argument("--baseline", type=Path, default=None, help="default: reports/baseline/<device>-<model>.json")
    a = p.parse_args(argv)
    if a.from_bench:
        results = [json.loads(a.from_bench.read_text())]
        if a.write_baseline and not results[0].get("complete", True):
            raise SystemExit(f"{a.from_bench} is a partial run (cut short); not writing a baseline from it")
    else:
        results = measure(a.model, a.device, a.dtype, a.seed, progress=True, rounds=a.rounds)
    kinds = settings(a.device)["kinds"]
    path = a.baseline or baseline_path(a.device, a.model)
    print(rounds_table(results, kinds).to_string(float_format="{:.4g}".format))
    if a.write_baseline:
        print(f"wrote {write_baseline(results, kinds, path)}")
        return 0
    table, ok = check(results, path)
    print(table.to_string(index=False, float_format="{:.4g}".format))
    print("PASS" if ok else "FAIL: a figure is more than 5% worse than the baseline (or missing)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
