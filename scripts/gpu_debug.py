"""Bisect the CUDA decode path on the tiny model: eager vs graphs, triton vs sdpa (one-off diagnosis)."""
import sys
import traceback

import torch

sys.path.insert(0, ".")
from pocketlab import EngineOptions, QwenEngine  # noqa: E402
from pocketlab.synthetic import write_checkpoint  # noqa: E402

preset = sys.argv[1] if len(sys.argv) > 1 else "tiny-qwen3"
path = write_checkpoint(preset, f"/tmp/ck-{preset}")
prompt = list(range(3, 23))
runs = {}
for name, opts in {"sdpa-eager": dict(decode_attention="sdpa", cuda_graphs=False),
                   "triton-eager": dict(decode_attention="triton", cuda_graphs=False),
                   "triton-graphs": dict(decode_attention="triton", cuda_graphs=True),
                   "sdpa-graphs": dict(decode_attention="sdpa", cuda_graphs=True)}.items():
    try:
        eng = QwenEngine.from_pretrained(path, EngineOptions(device="cuda", dtype="float32", max_slots=4,
                                                             max_seq_len=256, prefill_chunk=16, **opts))
        r = eng.prefill(prompt)
        toks, logits = [r.next_token], [r.logits]
        for _ in range(6):
            r = eng.decode_step(toks[-1])
            toks.append(r.next_token)
            logits.append(r.logits)
        torch.cuda.synchronize()
        runs[name] = (toks, torch.stack(logits), eng.cache.k[max(eng.cache.k)][0, :, :30].clone())
        ref = runs["sdpa-eager"]
        print(name, toks, "logit diff", (runs[name][1] - ref[1]).abs().max(dim=-1).values.tolist(),
              "k diff per pos", (runs[name][2] - ref[2]).abs().amax(dim=(0, 2)).tolist(), flush=True)
    except Exception:
        traceback.print_exc()
        print(name, "FAILED", flush=True)
        break
