"""Tensor-parallel bench: prefill and batch decode at the world size torchrun gives (1: one device), SPMD.

    torchrun --nproc-per-node 2 -m pocketlab.tools.bench_tp --model qwen3-8b --out reports/gpu/tp2-qwen3-8b.json
    python -m pocketlab.tools.bench_tp --model qwen3-8b --out reports/gpu/tp1-qwen3-8b.json       (TP=1)

Every rank runs this same program: it builds the random-weight HF model of the preset on its device, hands the
tensors to a QwenEngine with tensor_parallel = the world size (each rank keeps its shard), and makes the same calls;
rank 0 prints and writes the figures (median seconds per prefill and per decode step, tokens/s).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from ..config import DTYPES, EngineOptions, ModelConfig
from ..engine import QwenEngine
from ..requests import BatchedRequest
from .synthetic import build_hf_model


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m pocketlab.tools.bench_tp", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny-qwen3", help="preset from pocketlab.tools.synthetic.PRESETS")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="", help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--batch-sizes", type=ints, default=(1, 32))
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--decode-prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if args.device == "cuda" else args.device

    hf = build_hf_model(args.model, 0, device, DTYPES[dtype])
    cfg = ModelConfig.from_dict(hf.config.to_dict())
    weights = dict(hf.state_dict())
    if cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    opts = EngineOptions(
        max_slots=max(args.batch_sizes),
        max_seq_len=max(args.prompt_len, args.decode_prompt) + args.new_tokens + args.warmup + 8,
        prefill_chunk=args.prompt_len,
        device=args.device,
        dtype=dtype,
        cuda_graphs=args.cuda_graphs,
        prefix_cache=False,
        tensor_parallel=world,
    )
    engine = QwenEngine(cfg, weights, opts)
    del hf, weights
    if args.device == "cuda":
        torch.cuda.empty_cache()
    gen = torch.Generator().manual_seed(0)  # the same prompts on every rank

    def tokens(n):
        return torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()

    result = {"model": args.model, "tensor_parallel": world, "dtype": dtype, "device": args.device}
    prompt, samples = tokens(args.prompt_len), []
    for _ in range(args.repeats + 1):  # the first run warms up
        engine.reset()
        start = time.perf_counter()
        engine.prefill(prompt)
        samples.append(time.perf_counter() - start)
    seconds = statistics.median(samples[1:])
    result["prefill"] = {"tokens": args.prompt_len, "seconds": seconds, "tokens_per_s": args.prompt_len / seconds}
    result["decode"] = []
    for b in args.batch_sizes:
        reqs = [BatchedRequest(i, tokens(args.decode_prompt), slot_id=i) for i in range(b)]
        engine.reset()
        engine.batch_prefill(reqs)
        for _ in range(args.warmup):  # CUDA graphs are captured here
            engine.batch_decode_step(reqs)
        steps = []
        for _ in range(args.new_tokens):
            start = time.perf_counter()
            engine.batch_decode_step(reqs)
            steps.append(time.perf_counter() - start)
        step = statistics.median(steps)
        result["decode"].append({"batch": b, "step_s": step, "tokens_per_s": b / step})
    if rank == 0:
        print(json.dumps(result, indent=2))
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2))
    if world > 1:
        from ..parallel import comm

        comm.teardown()
    return result


if __name__ == "__main__":
    main()
