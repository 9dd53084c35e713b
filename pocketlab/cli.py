"""`python -m pocketlab generate PATH --prompt ...` and `python -m pocketlab chat PATH`: text streamed to stdout,
progress and timing on stderr, bad input reported in one line (exit status 2).

PATH is a checkpoint folder (config.json, safetensors, tokenizer files) or a pocketlab.tools.synthetic preset
name with a tokenizer (e.g. tiny-qwen3-text), written under checkpoints/ on first use; a missing folder named
<preset>-seed<N> (as ensure_checkpoint names them) is written there.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

COMMANDS = ("generate", "chat")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m pocketlab", description="Generate text with a Qwen checkpoint.")
    sub = ap.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt, streaming the text")
    chat = sub.add_parser("chat", help="interactive multi-turn chat (/reset clears it, /exit or Ctrl-D ends it)")
    for p in (gen, chat):
        p.add_argument("path", help="checkpoint folder, or a synthetic preset name such as tiny-qwen3-text")
        p.add_argument("--device", default="cpu")
        p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: bf16 on CUDA, else fp32)")
        p.add_argument("--max-new-tokens", type=int, default=256)
        p.add_argument("--max-seq-len", type=int, default=4096)
        p.add_argument("--temperature", type=float, default=None, help="default: the checkpoint's; 0 = greedy")
        p.add_argument("--top-p", type=float, default=None)
        p.add_argument("--top-k", type=int, default=None)
        p.add_argument("--repetition-penalty", type=float, default=None, help="default: the checkpoint's; 1 = off")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--system", default=None, help="a system message")
        p.add_argument("--no-think", action="store_true", help="enable_thinking=False (Qwen3 / Qwen3.5 templates)")
        p.add_argument(
            "--tensor-parallel",
            type=int,
            default=1,
            help="split the model over N processes, one per device (under torchrun --nproc-per-node N, or spawned)",
        )
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--raw", action="store_true", help="feed the prompt as plain text, not through the chat template")
    return ap


def load(args, err):
    """The engine for args.path (one slot: a chat is one conversation), timing the load on stderr."""
    from .config import EngineOptions
    from .engine import QwenEngine
    from .tools.synthetic import PRESETS, TOKENIZERS, ensure_checkpoint

    path = Path(args.path)
    written = re.fullmatch(r"(.+)-seed(\d+)", path.name)  # checkpoints/<preset>-seed<N>: write it if missing
    if not (path / "config.json").is_file() and written and written[1] in PRESETS:
        path = ensure_checkpoint(written[1], path.parent, int(written[2]))
    elif not (path / "config.json").is_file():
        if args.path not in PRESETS:
            raise ValueError(
                f"{args.path} is neither a checkpoint folder (no config.json) nor a preset; presets with a tokenizer: "
                f"{sorted(TOKENIZERS)}"
            )
        path = ensure_checkpoint(args.path)
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    start = time.perf_counter()
    print(f"loading {path} ({args.device}, {dtype}) ...", file=err, flush=True)
    opts = EngineOptions(
        max_slots=1, max_seq_len=args.max_seq_len, device=args.device, dtype=dtype, tensor_parallel=args.tensor_parallel
    )
    if opts.tensor_parallel > 1:  # under torchrun, ranks other than 0 serve rank 0 inside launch and exit there
        from .parallel import launch

        engine = launch(path, opts)
    else:
        engine = QwenEngine.from_pretrained(path, opts)
    engine.require_tokenizer()
    print(f"loaded in {time.perf_counter() - start:.1f} s", file=err, flush=True)
    return engine


def sampling(engine, args):
    given = dict(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, repetition_penalty=args.repetition_penalty
    )
    overrides = {k: v for k, v in given.items() if v is not None}
    return engine.default_sampling(max_new_tokens=args.max_new_tokens, seed=args.seed, **overrides)


def reply(engine, prompt, args, out, err):
    """Stream one completion to `out`; its timing to `err`. Returns the Completion."""
    thinking = False if args.no_think else None
    start, first, completion = time.perf_counter(), None, None
    for delta in engine.stream([prompt], sampling(engine, args), enable_thinking=thinking):
        first = first or time.perf_counter()
        out.write(delta.text)
        out.flush()
        completion = delta.completion or completion
    end = time.perf_counter()
    assert first is not None and completion is not None  # the stream always ends with a done delta + Completion
    out.write("\n")
    n = len(completion.token_ids)
    rate = (n - 1) / (end - first) if n > 1 and end > first else float("nan")
    print(
        f"[{n} tokens, {completion.finish_reason}; prompt {len(completion.prompt_ids)} tokens, "
        f"{completion.reused_tokens} reused; first token {1000 * (first - start):.0f} ms, {rate:.1f} tokens/s]",
        file=err,
        flush=True,
    )
    return completion


def run_generate(engine, args, out, err) -> None:
    if args.raw:
        prompt = args.prompt
    else:
        prompt = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
        if not engine.tokenizer.chat_template:
            prompt = args.prompt
    reply(engine, prompt, args, out, err)


def run_chat(engine, args, stdin, out, err) -> None:
    """One conversation; each turn re-renders the whole chat through the template, and the engine's prefix cache
    computes only what the slot's history does not already hold."""
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    interactive = stdin.isatty()
    print("chat: /reset clears the conversation, /exit (or Ctrl-D) ends it", file=err, flush=True)
    while True:
        if interactive:
            print("you> ", end="", file=err, flush=True)
        line = stdin.readline()
        if not line or line.strip() == "/exit":
            return
        line = line.rstrip("\n")
        if line.strip() == "/reset":
            messages = list(start)
            print("(conversation cleared)", file=err, flush=True)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        completion = reply(engine, messages, args, out, err)
        messages.append({"role": "assistant", "content": completion.text})


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    out, err = sys.stdout, sys.stderr
    engine: object = None
    try:
        engine = load(args, err)
        if args.command == "generate":
            run_generate(engine, args, out, err)
        else:
            run_chat(engine, args, sys.stdin, out, err)
    except ValueError as exc:
        print(f"error: {exc}", file=err)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=err)
        return 130
    finally:
        if hasattr(engine, "close"):  # a tensor-parallel engine: stop the other ranks
            engine.close()
    return 0
