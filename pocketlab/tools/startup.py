"""Cold and warm process starts: the same checkpoint served by two fresh processes, the first with an empty
kernel cache folder, the second with what the first left there.

    python -m pocketlab.tools.startup --model qwen3-0.6b [--device cuda] [--max-slots 64] [--max-seq-len 4096]

Each child process times from_pretrained, the first token after it (a 128-token prefill and one decode step),
engine.warmup(), and the first token again after warm-up; it prints one JSON line. The table goes to stdout and
the JSON to reports/bench/startup-<device>-<model>.json. `--profile N` adds a third process, warm too, that runs
its first token under cProfile and keeps the N functions with the most cumulative time: where a warm start goes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

from .host_time import profile_call


def child(path: str, device: str, dtype: str, max_slots: int, max_seq_len: int, profile: int = 0) -> dict:
    """One process start, measured from inside (the parent times the whole process); with `profile`, only the
    first token, under cProfile."""
    import torch

    from pocketlab import EngineOptions, QwenEngine

    def timed(fn):
        t = time.perf_counter()
        out = fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return out, time.perf_counter() - t

    opts = EngineOptions(device=device, dtype=dtype, max_slots=max_slots, max_seq_len=max_seq_len)
    engine, load = timed(lambda: QwenEngine.from_pretrained(path, opts))
    prompt = list(range(1, 129))

    def first_token():
        engine.decode_step(engine.prefill(prompt, 0).next_token, 0)
        engine.reset()

    if profile:
        seconds, rows = profile_call(first_token, profile)
        return {"first_token_s": seconds, "first_token_profile": rows}
    _, cold = timed(first_token)
    report, warmup = timed(lambda: engine.warmup(progress=False))
    _, warm = timed(first_token)
    return {
        "from_pretrained_s": load,
        "first_token_s": cold,
        "warmup_s": warmup,
        "warmup_graphs": report.graphs,
        "warmup_events": report.events,
        "first_token_after_warmup_s": warm,
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m pocketlab.tools.startup", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny-qwen3", help="a preset (its checkpoint is written once) or a folder")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="")
    p.add_argument("--max-slots", type=int, default=64)
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--cache", default="", help="kernel cache folder (default: a new empty one)")
    p.add_argument("--root", default="checkpoints", help="where preset checkpoints are written")
    p.add_argument("--profile", type=int, default=0, help="N: a third, profiled warm start keeps its top N functions")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    dtype = a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32")
    if a.child:
        print(json.dumps(child(a.child, a.device, dtype, a.max_slots, a.max_seq_len, a.profile)))
        return {}
    from .synthetic import PRESETS, ensure_checkpoint

    path = ensure_checkpoint(a.model, a.root, tokenizer=False) if a.model in PRESETS else Path(a.model)
    cache = a.cache or tempfile.mkdtemp(prefix="pocketlab-cache-")
    if any(Path(cache).iterdir()):
        raise ValueError(f"the kernel cache folder {cache} is not empty: a cold start needs an empty one")
    runs = {}
    for start in ("cold", "warm") + (("profiled",) if a.profile else ()):
        cmd = [sys.executable, "-m", "pocketlab.tools.startup", "--child", str(path), "--device", a.device]
        cmd += ["--dtype", dtype, "--max-slots", str(a.max_slots), "--max-seq-len", str(a.max_seq_len)]
        cmd += ["--profile", str(a.profile)] if start == "profiled" else []
        env = {k: v for k, v in os.environ.items() if k not in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}
        t = time.perf_counter()
        out = subprocess.run(cmd, env=env | {"POCKETLAB_CACHE": cache}, capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(f"the {start} start failed:\n{out.stderr[-3000:]}")
        runs[start] = json.loads(out.stdout.strip().splitlines()[-1]) | {"process_s": time.perf_counter() - t}
    result = {"model": a.model, "device": a.device, "dtype": dtype, "max_slots": a.max_slots}
    result |= {"max_seq_len": a.max_seq_len, "cache": cache, "runs": runs}
    hidden = ("warmup_events", "first_token_profile")
    table = pd.DataFrame({k: {m: v for m, v in r.items() if m not in hidden} for k, r in runs.items()})
    print(table.to_string(float_format="{:.3g}".format))
    if a.profile:
        print(pd.DataFrame(runs["profiled"]["first_token_profile"]).to_string(float_format="{:.3g}".format))
    out_path = a.out or Path("reports/bench") / f"startup-{a.device.split(':')[0]}-{a.model}.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=1))
    print(f"wrote {out_path}")
    return result


if __name__ == "__main__":
    main()
