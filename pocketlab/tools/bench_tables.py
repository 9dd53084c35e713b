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
                "error": p.get("error", ""),
            }
            for p in result["peer"]
        ],
        columns=["mode", "batch", "new_tokens", "tokens/s", "error"],
    )
    for mode in sorted(set(peers["mode"])):
        rates = peers[peers["mode"] == mode].set_index("batch")["tokens/s"]
        decode[f"HF {mode} tokens/s"] = decode["batch"].map(rates)
        decode[f"vs HF {mode}"] = decode["tokens/s"] / decode[f"HF {mode} tokens/s"]
    ratio = pd.DataFrame(sorted(result["ratios"].items()), columns=["ratio", "value"])
    return {"ceilings": ceilings, "prefill": prefill, "decode": decode, "peer": peers, "ratios": ratio}


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
