"""A bench result (the JSON `tools.bench` writes) as DataFrames and printed tables."""

from __future__ import annotations

import pandas as pd


def tables(result: dict) -> dict[str, pd.DataFrame]:
    """The result as DataFrames: ceilings, prefill, decode (with the peers beside it), ratios."""
    c = result["ceilings"]
    ceilings = pd.DataFrame(
        [
            {
                "copy GB/s (r+w)": c["copy"]["bytes_per_s"] / 1e9,
                "matmul TFLOP/s": c["matmul"]["flop_per_s"] / 1e12,
                "matmul n": c["matmul"]["n"],
            }
        ]
    )
    prefill = pd.DataFrame(
        [
            {
                "kind": p["kind"],
                "prompt_len": p["prompt_len"],
                "tokens": p["tokens"],
                "ms": p["seconds"] * 1e3,
                "tokens/s": p["tokens_per_s"],
                "TFLOP/s": p["flop_per_s"] / 1e12,
                "of matmul": p["matmul_frac"],
            }
            for p in result["prefill"]
        ]
    )
    decode = pd.DataFrame(
        [
            {
                "batch": d["batch"],
                "step ms": d["step_s"] * 1e3,
                "p90 ms": d.get("step_p90_s", float("nan")) * 1e3,  # absent in JSONs from before it
                "tokens/s": d["tokens_per_s"],
                "roofline ms": d["roofline_step_s"] * 1e3,
                "roofline frac": d["roofline_frac"],
            }
            for d in result["decode"]
        ]
    )
    peers = pd.DataFrame(
        [
            {
                "mode": p["mode"],
                "batch": p["batch"],
                "new_tokens": p["new_tokens"],
                "tokens/s": p.get("tokens_per_s", float("nan")),
                "step p90 ms": p.get("step_p90_s", float("nan")) * 1e3,
                "error": p.get("error", ""),
            }
            for p in result["peer"]
        ],
        columns=["mode", "batch", "new_tokens", "tokens/s", "step p90 ms", "error"],
    )
    for mode in sorted(set(peers["mode"])):
        rates = peers[peers["mode"] == mode].set_index("batch")["tokens/s"]
        decode[f"HF {mode} tokens/s"] = decode["batch"].map(rates)
        decode[f"vs HF {mode}"] = decode["tokens/s"] / decode[f"HF {mode} tokens/s"]
    ratio = pd.DataFrame(sorted(result["ratios"].items()), columns=["ratio", "value"])
    return {
        "ceilings": ceilings,
        "start": start_table(result),
        "prefill": prefill,
        "decode": decode,
        "latency": latency_table(result),
        "serving": serving_table(result),
        "peer": peers,
        "ratios": ratio,
    }


def start_table(result: dict) -> pd.DataFrame:
    """First token cold and warm, and the warm-up between them, with what each compiled or captured."""
    rows = [{"what": name, "s": r["seconds"], **r["events"]} for name, r in result.get("start", {}).items()]
    return pd.DataFrame(rows)


def latency_table(result: dict) -> pd.DataFrame:
    """Decode step percentiles over keys crossing graph buckets, and what compiled or captured meanwhile."""
    keys = ("batch", "steps", "p50_s", "p90_s", "p99_s", "max_s", "max_over_p50")
    return pd.DataFrame(
        [
            {k: d[k] for k in keys} | {"positions": "..".join(map(str, d["positions"]))} | d["events"]
            for d in result.get("latency", [])
        ]
    )


def serving_table(result: dict) -> pd.DataFrame:
    """The end-to-end trace: output tokens/s and request latency, ours, HF continuous batching's and (where that
    refuses the model) HF generate()'s over arrival batches."""
    serving = result.get("serving") or {}
    rows = [
        {"engine": name} | {k: v for k, v in serving[name].items() if k != "events"}
        for name in ("pocketlab", "hf", "hf_batches")
        if name in serving
    ]
    return pd.DataFrame(rows)


def print_tables(result: dict) -> None:
    m = result["meta"]
    print(
        f"\n{m['config']['model']} on {m['device_name']} ({m['config']['dtype']}, torch {m['torch']}, "
        f"transformers {m['transformers']})"
    )
    with pd.option_context("display.width", 160, "display.max_columns", 20, "display.float_format", "{:.4g}".format):
        for name, df in tables(result).items():
            if len(df):
                print(f"\n[{name}]\n{df.to_string(index=False)}")
