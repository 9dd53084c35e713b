"""Which GEMV launches read the decode projections' weights fastest: python -m pocketlab.layers.gemv_sweep

On CUDA, for the projections of the Qwen3-0.6B, Qwen3-8B, Qwen3.5 and MoE decode shapes at 1 and MAX_ROWS rows:
every candidate launch of layers.gemv (ROWS, BLOCK_N, BLOCK_K, warps) as weight-read bandwidth, beside what the
default engine runs there today (the fused matmul where there is an epilogue, else cuBLAS) and cuBLAS's bare matmul.
Times are medians of CUDA-graph replays cycling over weight copies (invariant.sweep.graph_ms), so every call reads
its weight from HBM. Prints the best launches of each shape and a summary against `launch_for`'s choice.

`--forms`: each tile with one and with two weight tiles ahead (`Launch.ahead`), at one row count; `--shapes` picks
shapes by name (here and in `--norm-chain`).

`--norm-chain`: where a pre-norm costs least, in a graph of 28 layers of [normed projection -> residual projection]
at one row (the programmatic dependent launches overlapping as in a decode step): no norm at all, the norm as its
own kernel, and folded into the GEMV at `launch_for`'s launch and at every candidate.

`--tma-chain`: the same chain without the norm, layers.gemv at `launch_for`'s launches against layers.gemv_tma's
TMA ring at every `RINGS` shape: whether weight tiles staged in shared memory, more of them in flight, read faster.

`--resources` (no GPU needed): both kernels compiled for sm_90 by this Triton (one row, no folded norm), the MoE
experts' gate_up launch of layers.moe_gemv beside its TMA-ring form (layers.moe_gemv_tma) and its down launch, the
Gated DeltaNet decode state step with what it folds in, and the fused matmul's few-row tiles, with the registers a
thread, the shared memory a program and the TMA loads in the machine code (Triton's cuobjdump).
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import os
import re
import subprocess
import tempfile
from typing import cast

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from tqdm import tqdm

from . import decode_attention, gemv, gemv_tma, linear_decode, matmul_tma, moe_gemv
from .gemv_tma import Ring, _gemv_tma
from .invariant import linear as fused_linear
from .invariant import matmul, rms_norm
from .invariant.matmul import PLAIN, RESIDUAL, SWIGLU
from .invariant.sweep import graph_ms, named
from .moe_gemv_tma import _expert_gate_up_tma
from .norm import RMSNorm

SHAPES = {  # name: (N, K, epilogue); for swiglu N is the output width and the weight holds 2N rows
    "0.6b qkv": (4096, 1024, PLAIN), "0.6b o+res": (1024, 2048, RESIDUAL), "0.6b gate_up": (3072, 1024, SWIGLU),
    "0.6b down+res": (1024, 3072, RESIDUAL), "0.6b lm_head": (151936, 1024, PLAIN),
    "0.8b gdn in": (8224, 1024, PLAIN), "8b qkv": (6144, 4096, PLAIN), "8b o+res": (4096, 4096, RESIDUAL),
    "8b gate_up": (12288, 4096, SWIGLU), "8b down+res": (4096, 12288, RESIDUAL), "8b lm_head": (151936, 4096, PLAIN),
    "9b gdn in": (12352, 4096, PLAIN), "moe router 128": (128, 2048, PLAIN), "moe router 256": (256, 2048, PLAIN),
    "35b shared gate_up": (512, 2048, SWIGLU), "35b shared down": (2048, 512, RESIDUAL),
    "30b qkv": (5120, 2048, PLAIN), "30b o+res": (2048, 4096, RESIDUAL),
}  # fmt: skip
BLOCK_N = (2, 4, 8, 16)
BLOCK_K = (256, 512, 1024)
WARPS = (4, 8)
AHEAD = (1, 2)  # --forms: weight tiles in flight


def candidates(M: int, forms: bool = False) -> list[gemv.Launch]:
    rows = sorted({triton.next_power_of_2(M), gemv.MAX_ROWS})
    if forms:  # one row count, the tiles that ever won, one or two tiles ahead
        return [gemv.Launch(*v) for v in itertools.product(rows[:1], BLOCK_N[:3], BLOCK_K, WARPS, AHEAD)]
    return [gemv.Launch(r, n, k, w) for r, n, k, w in itertools.product(rows, BLOCK_N, BLOCK_K, WARPS)]


def today(x, w, res, epilogue):
    """What the default engine runs at these rows before layers.gemv: the fused kernel with an epilogue, else cuBLAS."""
    if epilogue == PLAIN:
        return F.linear(x, w)
    return fused_linear(x, w, residual=res, swiglu=epilogue == SWIGLU)


def sweep(rows: list[int], top: int, shapes: list[str], forms: bool) -> list[tuple]:
    summary = []
    print(f"{'shape':<20}{'M':>3}  {'launch (rows, bn, bk, warps, ahead)':<46}{'ms':>9}{'TB/s':>7}")
    for name, (N, K, epilogue) in tqdm([(s, SHAPES[s]) for s in shapes], desc="shapes"):
        rows_w = 2 * N if epilogue == SWIGLU else N
        copies = max(1, min(16, (800 * 2**20) // (rows_w * K * 2)))
        weights = [torch.randn(rows_w, K, device="cuda", dtype=torch.bfloat16) * K**-0.5 for _ in range(copies)]
        summary += [sweep_rows(name, N, K, epilogue, M, weights, top, forms) for M in rows]
        del weights
        torch.cuda.empty_cache()
    return summary


def sweep_rows(name: str, N: int, K: int, epilogue: int, M: int, weights: list[torch.Tensor], top: int,
               forms: bool) -> tuple:  # fmt: skip
    """Every candidate launch at M rows (the best `top` printed); the chosen one against today's path and cuBLAS."""
    gb = weights[0].numel() * 2 / 1e9
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(M, N, device="cuda", dtype=torch.bfloat16) if epilogue == RESIDUAL else None
    y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    tried = candidates(M, forms)
    timed = sorted(
        ((graph_ms(lambda w, t=t: gemv.launch(x, w, None, y, t, epilogue, res), weights), t) for t in tried),
        key=lambda p: p[0],
    )
    for ms, t in timed[:top]:
        launch = str((t.rows, t.block_n, t.block_k, t.num_warps, t.ahead))
        print(f"{name:<20}{M:>3}  {launch:<46}{ms:>9.4f}{gb / ms:>7.2f}")
    chosen = gemv.launch_for(M, N, K, x.device)
    chosen_ms = next((ms for ms, t in timed if t == chosen), None)
    if chosen_ms is None:
        chosen_ms = graph_ms(lambda w: gemv.launch(x, w, None, y, chosen, epilogue, res), weights)
    now_ms = graph_ms(lambda w: today(x, w, res, epilogue), weights)
    cublas_ms = graph_ms(lambda w: F.linear(x, w), weights)
    solo = gemv.launch(x[:1], weights[0], None, y[:1].clone(), chosen, epilogue, None if res is None else res[:1])
    batch = gemv.launch(x, weights[0], None, y.clone(), chosen, epilogue, res)
    bits = "equal" if torch.equal(solo[0], batch[0]) else "DIFFER"
    return name, M, gb, chosen, chosen_ms, timed[0], now_ms, cublas_ms, bits


NORM_CHAIN = {  # name: (N, K) of the normed projection; the residual projection is its transpose
    "0.6b qkv/o": (4096, 1024), "0.8b gdn in/out": (8224, 1024), "8b qkv/o": (6144, 4096),
    "9b gdn in/out": (12352, 4096), "35b gdn in/out": (12352, 2048),
}  # fmt: skip


def chain_us(layer, weights: list[tuple], h: torch.Tensor) -> float:
    """Median microseconds per layer of one graph chaining `layer(h, a, b, norm)` through every layer's weights."""
    state = [h]

    def step(args):
        state[0] = layer(state[0], *args)

    return graph_ms(step, weights, runs=20) * 1e3


def norm_chain(shapes: list[str], layers: int = 28, top: int = 4) -> None:
    def folded(t):
        def layer(h, a, b, norm):
            y = torch.empty(1, a.shape[0], dtype=h.dtype, device=h.device)
            return gemv.gemv(gemv.launch(h, a, None, y, t, PLAIN, None, norm), b, residual=h)

        return layer

    for name, (N, K) in [(s, NORM_CHAIN[s]) for s in shapes]:
        gen = torch.Generator(device="cuda").manual_seed(0)
        weights = [
            (torch.randn(N, K, device="cuda", generator=gen).bfloat16() * K**-0.5,
             torch.randn(K, N, device="cuda", generator=gen).bfloat16() * N**-0.5,
             RMSNorm(torch.rand(K, device="cuda", generator=gen).bfloat16() + 0.5, 1e-6, False, kernels=None))
            for _ in range(layers)
        ]  # fmt: skip
        for *_, norm in weights:
            norm.norm = rms_norm  # the Triton row kernel, as the default CUDA engine runs it
        h = torch.randn(1, K, device="cuda", generator=gen).bfloat16()
        plain = chain_us(lambda h, a, b, n: gemv.gemv(gemv.gemv(h, a), b, residual=h), weights, h)
        own = chain_us(lambda h, a, b, n: gemv.gemv(gemv.gemv(n(h), a), b, residual=h), weights, h)
        chosen = gemv.launch_for(1, N, K, h.device, normed=True)
        print(f"{name:<16} us/layer: no norm {plain:.2f}, norm kernel {own:.2f}, folded {chosen} "
              f"{chain_us(folded(chosen), weights, h):.2f}")  # fmt: skip
        tried = [(chain_us(folded(t), weights, h), t) for t in candidates(1) if t.block_k <= K]
        for us, t in sorted(tried, key=lambda p: p[0])[:top]:
            print(f"{name:<16}   folded {(t.block_n, t.block_k, t.num_warps)}  {us:.2f}")
        del weights
        torch.cuda.empty_cache()


RINGS = [Ring(n, k, s) for n, k, s in itertools.product((4, 8, 16), (64, 128, 256), (2, 3, 4, 6))]  # TMA boxes <= 256


def tma_chain(shapes: list[str], layers: int = 28, top: int = 6) -> None:
    for name, (N, K) in [(s, NORM_CHAIN[s]) for s in shapes]:
        gen = torch.Generator(device="cuda").manual_seed(0)
        weights = [
            (torch.randn(N, K, device="cuda", generator=gen).bfloat16() * K**-0.5,
             torch.randn(K, N, device="cuda", generator=gen).bfloat16() * N**-0.5)
            for _ in range(layers)
        ]  # fmt: skip
        h = torch.randn(1, K, device="cuda", generator=gen).bfloat16()
        base = chain_us(lambda h, a, b: gemv.gemv(gemv.gemv(h, a), b, residual=h), weights, h)
        print(f"{name:<16} us/layer: layers.gemv {base:.2f}")
        tried = []
        for ring in tqdm(RINGS, desc=name, leave=False):

            def layer(h, a, b, r=ring):
                y = gemv_tma.launch(h, a, None, h.new_empty(1, a.shape[0]), r)
                return gemv_tma.launch(y, b, None, h.new_empty(1, b.shape[0]), r, RESIDUAL, h)

            tried.append((chain_us(layer, weights, h), ring))
        for us, ring in sorted(tried, key=lambda p: p[0])[:top]:
            print(f"{name:<16}   TMA ring {(ring.block_n, ring.block_k, ring.stages)}  {us:.2f}  ({base / us:.3f}x)")
        del weights
        torch.cuda.empty_cache()


def compiled(kernel, signature: dict, constants: dict, num_warps: int, num_stages: int = 3, aligned=()) -> str:
    """`kernel` built for sm_90 (PDL on, as the H200 runs it): its registers, shared memory, TMA loads (and
    warpgroup MMA instructions, where it has any). Pointers, sizes (N, K, H, I), strides and the integers named in
    `aligned` carry the divisibility by 16 that the JIT finds in them at the Qwen shapes: without it no load is
    vectorised and no loop pipelined (the figures would be another kernel's)."""
    return machine_code(kernel, signature, constants, num_warps, num_stages, aligned)[0]


def loop_ops(sass: str) -> list[dict[str, int]]:
    """Per loop of the machine code (each backward branch and what it jumps over): its barriers, shared-memory stores
    and loads, global loads and float32 FMAs, by opcode."""
    ops = [(int(a, 16), op.split()) for a, op in re.findall(r"/\*([0-9a-f]{4})\*/\s+([^;]*);", sass)]
    opcodes = [(a, words[1] if words[0].startswith("@") else words[0], words) for a, words in ops if words]
    loops = []
    for address, opcode, words in opcodes:
        target = int(words[-1], 16) if opcode == "BRA" and words[-1].startswith("0x") else address
        if target < address:
            body = [op for a, op, _ in opcodes if target <= a <= address]
            loops.append({k: sum(op.startswith(k) for op in body) for k in ("BAR", "STS", "LDS", "LDG", "FFMA")})
    return loops


def a_step(sass: str) -> str:
    """The instruction counts of the machine code's loop that does the FMAs (loop_ops)."""
    loop = next((ops for ops in loop_ops(sass) if ops["FFMA"]), None)
    return "a step: " + (", ".join(f"{k} {v}" for k, v in loop.items()) if loop else "no loop")


def machine_code(kernel, signature: dict, constants: dict, num_warps: int, num_stages: int = 3,
                 aligned=()) -> tuple[str, str]:  # fmt: skip
    """(compiled's summary, the SASS) of `kernel` built for sm_90 as `compiled` says."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constants = dict(constants, PDL=True)
    names = list(inspect.signature(kernel.fn).parameters)
    divisible = [n for n, kind in signature.items()
                 if kind.startswith("*") or n in ("N", "K", "H", "I", *aligned) or n.startswith("stride_")]  # fmt: skip
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    signature = signature | dict.fromkeys(constants, "constexpr")
    source = ASTSource(kernel, signature=signature, constexprs=constants, attrs=attrs)
    options = dict(num_warps=num_warps, num_stages=num_stages, launch_pdl=True)
    built = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(built.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    regs = cast(re.Match[str], re.search(r"REG:(\d+)", usage))[1]  # cuobjdump -res-usage prints REG:
    mma = f", {sass.count('HGMMA')} warpgroup MMAs" if "HGMMA" in sass else ""
    return f"{regs:>4} registers {built.metadata.shared:>6} B shared {sass.count('UTMALDG'):>2} TMA loads{mma}", sass


GEMV_SIGNATURE = dict.fromkeys(("x_ptr", "w_ptr", "b_ptr", "y_ptr", "res_ptr", "g_ptr", "conv_ptr", "cw_ptr"), "*bf16")
GEMV_SIGNATURE |= {"slot_ptr": "*i64", "into_ptr": "*bf16", "into_row_ptr": "*i64", "eps": "fp32"} | dict.fromkeys(
    ("rows", "N", "K", "C", "stride_xm", "stride_wn", "stride_ym", "stride_rm", "stride_cs", "stride_cc"), "i32"
)


def gemv_code(t: gemv.Launch, epilogue: int) -> tuple[str, str]:
    """machine_code of layers.gemv's one-row launch `t` (no norm, bias or conv)."""
    constants = dict(HAS_BIAS=False, EPILOGUE=epilogue, NORM=0, CONV_K=0, TAPS=1, ROWS=1, BLOCK_N=t.block_n,
                     BLOCK_K=t.block_k, AHEAD=t.ahead)  # fmt: skip
    return machine_code(gemv._gemv, GEMV_SIGNATURE, constants, t.num_warps)


def resources() -> None:
    print(f"Triton {triton.__version__}, sm_90")
    t: gemv.Launch | moe_gemv.Launch  # layers.gemv's launches, then moe_gemv's
    for name, (N, K, epilogue) in SHAPES.items():
        t = gemv.launch_for(1, N, K, torch.device("cuda"))
        usage, sass = gemv_code(t, epilogue)
        print(f"{name:<20} layers.gemv {(t.block_n, t.block_k, t.ahead)!s:<16}{usage}; {a_step(sass)}")
    ring_args = dict.fromkeys(("x_ptr", "b_ptr", "y_ptr", "res_ptr", "g_ptr"), "*bf16") | {"eps": "fp32"}
    ring_args |= {"N": "i32", "K": "i32"}
    for r in RINGS:
        signature = ring_args | {"w_desc": f"tensordesc<bf16[{r.block_n}, {r.block_k}]>"}
        constants = dict(HAS_BIAS=False, EPILOGUE=RESIDUAL, NORM=0, BLOCK_N=r.block_n, BLOCK_K=r.block_k,
                         STAGES=r.stages)  # fmt: skip
        print(f"{'TMA ring':<20} {(r.block_n, r.block_k, r.stages)!s:<28}"
              f"{compiled(_gemv_tma, signature, constants, r.num_warps)}")  # fmt: skip
    experts = dict.fromkeys(("x_ptr", "w_ptr", "sw_ptr", "g_ptr", "h_ptr"), "*bf16") | {
        "ids_ptr": "*i64",
        "eps": "fp32",
    }
    experts |= dict.fromkeys(("H", "I", "stride_x", "stride_we", "stride_wn", "stride_sn"), "i32")
    t = moe_gemv.tiles(torch.device("cuda")).gate_up
    constants = dict(TOP_K=8, NORM=2, KP=8, BLOCK_N=t.block_n, BLOCK_K=t.block_k, SHARED=True, IDS_READY=True)
    usage, sass = machine_code(moe_gemv._gate_up, experts, constants, t.num_warps)
    print(f"{'experts, top-8':<20} moe_gemv gate_up {(t.block_n, t.block_k)!s:<11}{usage}; {a_step(sass)}")
    pairs = {"x_ptr": "*bf16", "g_ptr": "*bf16", "ids_ptr": "*i64", "h_ptr": "*bf16", "eps": "fp32"}
    pairs |= dict.fromkeys(("I", "H", "stride_x", "PAIRS"), "i32")
    for r in RINGS:
        signature = pairs | dict.fromkeys(("w_desc", "s_desc"), f"tensordesc<bf16[{r.block_n}, {r.block_k}]>")
        constants = dict(TOP_K=8, NORM=2, SHARED=True, BLOCK_N=r.block_n, BLOCK_K=r.block_k, STAGES=r.stages)
        print(f"{'experts, top-8':<20} TMA ring {(r.block_n, r.block_k, r.stages)!s:<19}"
              f"{compiled(_expert_gate_up_tma, signature, constants, r.num_warps)}")  # fmt: skip
    down_args = dict.fromkeys(("h_ptr", "out_ptr", "shared_ptr", "gate_ptr", "residual_ptr"), "*bf16")
    down_args |= {"weights_ptr": "*fp32", "ids_ptr": "*i64"} | dict.fromkeys(("H", "I", "stride_s", "stride_g",
                                                                               "stride_r"), "i32")  # fmt: skip
    t = moe_gemv.tiles(torch.device("cuda")).down
    signature = down_args | dict.fromkeys(("w_ptr", "sw_ptr"), "*bf16")
    signature |= dict.fromkeys(("stride_we", "stride_wn", "stride_sn"), "i32")
    constants = dict(TOP_K=8, KP=8, SHARED=False, SHARED_W=True, RESIDUAL=True, BLOCK_N=t.block_n, BLOCK_K=t.block_k)
    usage, sass = machine_code(moe_gemv._down_sum, signature, constants, t.num_warps)
    print(f"{'experts down, top-8':<20} moe_gemv down {(t.block_n, t.block_k)!s:<14}{usage}; {a_step(sass)}")
    state_step_resources()
    attention_resources()
    few_row_matmul_resources()


def state_step_resources() -> None:
    """The Gated DeltaNet decode step (dk = dv = 128, as Qwen3.5's) as it runs alone and with the gated norm."""
    names = ("q_ptr", "k_ptr", "v_ptr", "g_ptr", "beta_ptr", "o_ptr", "z_ptr", "norm_w_ptr", "pf_ptr")
    signature = dict.fromkeys(names, "*bf16") | dict.fromkeys(("state_ptr", "into_ptr", "neg_a_ptr", "dt_ptr"), "*fp32")
    signature |= {"slot_ptr": "*i64", "into_row_ptr": "*i64", "arrived_ptr": "*i32", "pf_bytes": "i32"}
    signature |= dict.fromkeys(("scale", "eps", "norm_eps"), "fp32")
    signature |= {name: "i32" for name in inspect.signature(linear_decode._recurrent_step.fn).parameters
                  if name.startswith("stride_")}  # fmt: skip
    for norm, prefetch in ((False, False), (True, False), (True, True)):
        constants = dict(GROUP=1, DK=128, DV=128, BLOCK_V=linear_decode.STATE_BLOCK_V, RAW_GATES=True, NORM=norm,
                         X_DTYPE=tl.bfloat16, WX_DTYPE=tl.bfloat16, PREFETCH=prefetch)  # fmt: skip
        print(
            f"{'gdn state step':<20} norm {norm!s:<5} prefetch {prefetch!s:<5}  "
            f"{compiled(linear_decode._recurrent_step, signature, constants, linear_decode.STATE_WARPS)}"
        )


def attention_resources() -> None:
    """The decode attention (Qwen3's norms, head_dim 128, bf16 cache): 8 query heads a KV head and four key blocks a
    split (8B at batch 32), with and without the L2 prefetch of the o_proj weight; 2 query heads and one block a
    split (0.6B at batch 1, prefetching); each with its split's first block read after the PDL wait or before it."""
    kernel = decode_attention._partial_attention
    params = inspect.signature(kernel.fn).parameters
    signature = {n: "i32" for n in params if n.startswith("stride_")} | {"pf_bytes": "i32"}
    signature |= dict.fromkeys(("q_ptr", "kn_ptr", "vn_ptr", "k_ptr", "v_ptr", "out_ptr", "qw_ptr", "kw_ptr",
                                "cos_ptr", "sin_ptr", "gate_ptr", "pf_ptr"), "*bf16")  # fmt: skip
    signature |= {"slot_ptr": "*i64", "len_ptr": "*i32", "pos_ptr": "*i64", "arrived_ptr": "*i32"}
    signature |= {"o_ptr": "*fp32", "lse_ptr": "*fp32", "scale": "fp32", "eps": "fp32"}
    for G, split_len, prefetch, early in ((8, 256, False, False), (8, 256, True, False), (8, 256, False, True),
                                          (2, 64, True, False), (2, 64, True, True)):  # fmt: skip
        constants = dict(G=G, BLOCK_G=16, D=128, ROT=128, HAS_NORM=True, OFFSET=False, GATED=False, BLOCK_N=64,
                         SPLIT_LEN=split_len, BLOCK_S=4, MERGE=4, PRECISION="tf32", PREFETCH=prefetch,
                         EARLY=early)  # fmt: skip
        form = f"G {G} keys {split_len:<3} prefetch {prefetch!s:<5} early {early!s:<5}"
        print(f"{'decode attention':<20} {form:<40}{compiled(kernel, signature, constants, 4, 2)}")


def few_row_matmul_resources() -> None:
    """The fused matmul (invariant.matmul) at 17-64 rows, the default tiles (32x64 and 64x64, four stages) and the
    candidates: shared memory decides how many of its programs an SM holds (228 KiB an SM, 1 KiB of it reserved per
    program), so how many of the 8B gate_up's tiles run at once."""
    for epilogue, what in ((RESIDUAL, "o, down + residual"), (SWIGLU, "gate_up + SwiGLU")):
        for bm, bn, stages in ((32, 64, 4), (32, 64, 3), (32, 32, 4), (64, 64, 4), (64, 32, 3)):
            usage = fused_matmul_usage(matmul.Tiles(bm, bn, 4, stages, matmul.LAST_SUMS), epilogue)
            print(f"{what:<20} fused matmul {bm}x{bn} s{stages:<8}{with_programs_an_sm(usage)}")
        for bm in (16, 32, 64):  # layers.matmul_tma's default ring, as W @ x^T
            ring = matmul_tma.DEFAULT_RING
            usage = tma_matmul_usage(bm, ring, epilogue)
            print(f"{what:<20} TMA matmul {ring.block_n}x{bm} s{ring.stages:<9}{with_programs_an_sm(usage)}")


def with_programs_an_sm(usage: str) -> str:
    """`compiled`'s line and how many such programs an SM holds by shared memory (228 KiB, 1 KiB a program kept)."""
    shared = int(cast(re.Match[str], re.search(r"(\d+) B shared", usage))[1])
    return f"{usage}, {(228 << 10) // (shared + 1024)} programs an SM by shared memory"


def fused_matmul_usage(t, epilogue: int) -> str:
    """`compiled` for the fused matmul's launch `t` (an invariant.matmul.Tiles) with `epilogue`, in bf16."""
    names = ("x_ptr", "w_ptr", "b_ptr", "y_ptr", "res_ptr")
    signature = dict.fromkeys(names, "*bf16") | {"part_ptr": "*fp32", "arrived_ptr": "*i32"}
    signature |= dict.fromkeys(("rows", "N", "K", "k_per_split", "split_k", "stride_xm", "stride_wn", "stride_ym",
                                "stride_ps", "stride_pm", "stride_rm"), "i32") | {"eps": "fp32"}  # fmt: skip
    constants = dict(MODE=t.mode, HAS_BIAS=False, EPILOGUE=epilogue, ROW_NORM=False, K_ROW=1, PRECISION="tf32",
                     BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=128,
                     stride_wk=1)  # fmt: skip  # the JIT makes a 1 a constant
    return compiled(matmul._matmul, signature, constants, t.num_warps, t.num_stages, ("k_per_split",))


def tma_matmul_usage(block_m: int, ring, epilogue: int) -> str:
    """`compiled` for layers.matmul_tma's launch of `ring` at block_m rows with `epilogue`, in bf16 (its stages as
    the launch caps them for SwiGLU)."""
    stages = matmul_tma.stages_that_fit(ring, block_m, 128 * 2, epilogue == SWIGLU)
    signature = {"x_desc": f"tensordesc<bf16[{block_m}, 128]>", "w_desc": f"tensordesc<bf16[{ring.block_n}, 128]>"}
    signature |= dict.fromkeys(("w_ptr", "b_ptr", "y_ptr", "res_ptr"), "*bf16")
    signature |= dict.fromkeys(("part_ptr", "squares_in_ptr", "squares_out_ptr"), "*fp32") | {"arrived_ptr": "*i32"}
    ints = ("rows", "N", "K", "k_per_split", "split_k", "tiles_in", "stride_wn", "stride_ym", "stride_ps",
            "stride_pm", "stride_rm")  # fmt: skip
    signature |= dict.fromkeys(ints, "i32") | {"eps": "fp32"}
    constants = dict(HAS_BIAS=False, EPILOGUE=epilogue, PRECISION="tf32", BLOCK_M=block_m, BLOCK_N=ring.block_n,
                     BLOCK_K=128, STAGES=stages, PREFETCH=ring.prefetch, TILES_IN=0, SQUARES_OUT=False)  # fmt: skip
    return compiled(matmul_tma._matmul_tma, signature, constants, 4, 3, ("k_per_split",))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1", help=f"row counts, comma-separated (at most {gemv.MAX_ROWS})")
    ap.add_argument("--top", type=int, default=4, help="launches printed per shape and row count")
    ap.add_argument("--norm-chain", action="store_true", help="the pre-norm's cost, own kernel vs folded (above)")
    ap.add_argument("--tma-chain", action="store_true", help="layers.gemv against the TMA ring (above)")
    ap.add_argument("--resources", action="store_true", help="registers, shared memory, TMA loads (sm_90, no GPU)")
    ap.add_argument("--forms", action="store_true", help="one or two tiles ahead too (one row count)")
    ap.add_argument("--shapes", default="", help="names containing any of these, comma-separated, _ for a space")
    a = ap.parse_args(argv)
    if a.norm_chain:
        return norm_chain(named(NORM_CHAIN, a.shapes), top=a.top)
    if a.tma_chain:
        return tma_chain(named(NORM_CHAIN, a.shapes), top=a.top)
    if a.resources:
        return resources()
    shapes = named(SHAPES, a.shapes)
    summary = sweep([int(v) for v in a.rows.split(",")], a.top, shapes, a.forms)
    print(f"\n{'shape':<20}{'M':>3}{'chosen':>18}{'ms':>9}{'TB/s':>7}{'best ms':>9}{'today ms':>10}{'cuBLAS ms':>11}"
          f"{'today/chosen':>14}  row 0 alone vs in the batch")  # fmt: skip
    for name, M, gb, t, ms, (best_ms, _), now_ms, cublas_ms, bits in summary:
        launch = f"{t.rows},{t.block_n},{t.block_k},{t.num_warps},{t.ahead}"
        print(f"{name:<20}{M:>3}{launch:>18}{ms:>9.4f}{gb / ms:>7.2f}{best_ms:>9.4f}{now_ms:>10.4f}{cublas_ms:>11.4f}"
              f"{now_ms / ms:>14.2f}  {bits}")  # fmt: skip


if __name__ == "__main__":
    main()
