"""Decode GEMVs as stages of one persistent launch, grid barriers between: python -m pocketlab.layers.stage_chain

Why: at one row a decode layer is a chain of short launches, and at the small shapes each costs several times its
weight read (reports/gpu/prefetch-chain-h200.txt: Qwen3-0.6B's four GEMVs take 19.9 us a layer, 1.58 TB/s, with
programmatic dependent launch). The question this experiment answers on the GPU before any engine path is built on
it: does one launch whose programs stay resident (one per SM) and meet at a grid barrier (an arrival count in
global memory) between stages read the same weights faster than a launch per stage? Each program loads its first
weight tile of the next stage before it waits at the barrier, as a PDL launch does before its wait.

The stages are rows of a table (addresses, widths, kind), so one launch can run a layer or the whole stack. It runs
on CUDA only: the barrier needs every program resident at once, which Triton's interpreter (programs one after
another) cannot give. Its sums are checked against layers.gemv's (the engine's path) before it is timed.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl

PLAIN, RESIDUAL, SWIGLU = 0, 1, 2
FIELDS = 8  # a stage's table row: weight, x, y, residual, norm weight (addresses; 0 = none), N, K, kind


@triton.jit
def _grid_sync(count_ptr, target):
    """Wait until `target` arrivals were counted (each program arrives once per stage, so stage s waits for
    (s + 1) x programs): every thread's stores go before the arrival, every later load after the others'."""
    tl.debug_barrier()
    seen = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu") + 1
    while seen < target:
        seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _tile(w_ptr, n, k, N, K, live):
    return tl.load(w_ptr + n.to(tl.int64)[:, None] * K + k[None, :], mask=live & (n < N)[:, None] & (k < K)[None, :],
                   other=0.0)  # fmt: skip


@triton.jit
def _stage_args(table_ptr, s):
    row = table_ptr + s * 8
    w = tl.load(row).to(tl.pointer_type(tl.bfloat16))
    N = tl.load(row + 5).to(tl.int32)
    K = tl.load(row + 6).to(tl.int32)
    kind = tl.load(row + 7).to(tl.int32)
    return row, w, N, K, kind


@triton.jit
def _first_tiles(table_ptr, s, S, pid, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's first weight tile (and the up half's, for SwiGLU) of stage s: zeros when it has none."""
    live = s < S
    _, w, N, K, kind = _stage_args(table_ptr, tl.minimum(s, S - 1))
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    return _tile(w, n, k, N, K, live), _tile(w + N.to(tl.int64) * K, n, k, N, K, live & (kind == 2))


@triton.jit
def _stages(table_ptr, count_ptr, S, eps, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Stage s: y = epilogue(x @ W^T) over BLOCK_N-row blocks of W, block b by program b mod programs; x RMS-normed
    with weight g when the row has one (the sums scaled by 1/rms, as layers.gemv does); kind 1: y = residual + ...,
    kind 2: W is [gate | up] and y = silu(gate) * up. Then the grid barrier. One weight tile is in flight ahead
    of the one in use, the first of the next stage loaded before the barrier."""
    pid, P = tl.program_id(0), tl.num_programs(0)
    rows = tl.arange(0, BLOCK_N)
    w_first, up_first = _first_tiles(table_ptr, 0, S, pid, BLOCK_N, BLOCK_K)
    for s in range(S):
        row, w_ptr, N, K, kind = _stage_args(table_ptr, s)
        x_ptr = tl.load(row + 1).to(tl.pointer_type(tl.bfloat16))
        y_ptr = tl.load(row + 2).to(tl.pointer_type(tl.bfloat16))
        res_addr = tl.load(row + 3)
        g_addr = tl.load(row + 4)
        res_ptr = res_addr.to(tl.pointer_type(tl.bfloat16))
        g_ptr = g_addr.to(tl.pointer_type(tl.bfloat16))
        up_ptr = w_ptr + N.to(tl.int64) * K
        two = kind == 2
        has_norm = g_addr != 0
        for b in range(pid, tl.cdiv(N, BLOCK_N), P):
            n = b * BLOCK_N + rows
            lanes = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            lanes_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
            k = tl.arange(0, BLOCK_K)
            w, up = w_first, up_first
            if b != pid:
                w = _tile(w_ptr, n, k, N, K, True)
                up = _tile(up_ptr, n, k, N, K, two)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                w_next = _tile(w_ptr, n, k + BLOCK_K, N, K, True)
                up_next = _tile(up_ptr, n, k + BLOCK_K, N, K, two)
                x = tl.load(x_ptr + k, mask=k < K, other=0.0, cache_modifier=".cg").to(tl.float32)
                squares += x * x
                x = x * tl.load(g_ptr + k, mask=has_norm & (k < K), other=1.0).to(tl.float32)
                lanes += x[None, :] * w.to(tl.float32)
                lanes_up += x[None, :] * up.to(tl.float32)
                w, up = w_next, up_next
            total, total_up = tl.sum(lanes, axis=1), tl.sum(lanes_up, axis=1)
            if has_norm:
                inv_rms = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
                total, total_up = total * inv_rms, total_up * inv_rms
            live = n < N
            if kind == 1:
                res = tl.load(res_ptr + n, mask=live, other=0.0, cache_modifier=".cg").to(tl.float32)
                total = res + total.to(tl.bfloat16).to(tl.float32)
            if kind == 2:
                gate = total.to(tl.bfloat16).to(tl.float32)
                total = (gate / (1.0 + tl.exp(-gate))).to(tl.bfloat16).to(tl.float32) * total_up.to(tl.bfloat16).to(
                    tl.float32
                )
            tl.store(y_ptr + n, total.to(tl.bfloat16), mask=live)
        w_first, up_first = _first_tiles(table_ptr, s + 1, S, pid, BLOCK_N, BLOCK_K)
        _grid_sync(count_ptr, (s + 1) * P)
    if tl.atomic_add(count_ptr + 1, 1, sem="acq_rel", scope="gpu") == P - 1:  # every program is past every barrier
        tl.atomic_xchg(count_ptr, 0)
        tl.atomic_xchg(count_ptr + 1, 0)


def stage_row(w, x, y, residual=None, norm_weight=None, kind=PLAIN) -> list[int]:
    """A stage's table row; for SWIGLU, w holds 2N rows and y is [N]."""
    N = w.shape[0] // 2 if kind == SWIGLU else w.shape[0]
    addr = [t.data_ptr() if t is not None else 0 for t in (w, x, y, residual, norm_weight)]
    return addr + [N, w.shape[1], kind]


def resident(programs: int, block_n: int, block_k: int, warps: int) -> tuple[bool, str]:
    """Whether `programs` programs of this launch fit on the GPU at once (registers), as the barrier needs; why."""
    table = torch.zeros(1, FIELDS, dtype=torch.int64, device="cuda")
    counts = torch.zeros(2, dtype=torch.int32, device="cuda")
    kernel = _stages.warmup(table, counts, 1, 1e-6, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
                            grid=(programs,))  # fmt: skip
    kernel._init_handles()
    props = torch.cuda.get_device_properties(0)
    per_sm = 65536 // (kernel.n_regs * 32 * warps)
    fits = programs <= per_sm * props.multi_processor_count
    return fits, f"{kernel.n_regs} registers, {kernel.n_spills} spills, {per_sm} a SM"


def run(table: torch.Tensor, counts: torch.Tensor, programs: int, block_n: int, block_k: int, warps: int,
        eps: float = 1e-6) -> None:  # fmt: skip
    """One launch of every stage in `table` (int64 [S, FIELDS]); `counts`: two zeroed int32 (left zeroed)."""
    _stages[(programs,)](table, counts, table.shape[0], eps, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)


SHAPES = {"0.6b": (1024, 4096, 2048, 3072), "8b": (4096, 6144, 4096, 12288)}  # hidden, qkv, attention out, mlp


def _layers(shape: str, count: int, gen: torch.Generator) -> list[dict]:
    hidden, qkv, att, mlp = SHAPES[shape]

    def weight(n, k):
        return torch.randn(n, k, device="cuda", generator=gen).bfloat16() * k**-0.5

    return [
        dict(qkv=weight(qkv, hidden), o=weight(hidden, att), gate_up=weight(2 * mlp, hidden), down=weight(hidden, mlp),
             g1=(torch.rand(hidden, device="cuda", generator=gen) + 0.5).bfloat16(),
             g2=(torch.rand(hidden, device="cuda", generator=gen) + 0.5).bfloat16())
        for _ in range(count)
    ]  # fmt: skip


def _table(layers: list[dict], h, qkv_out, mid) -> torch.Tensor:
    """A decode layer's four GEMVs per layer: qkv (normed), o + residual (its input: the first columns of qkv, a
    stand-in for attention), gate_up (normed, SwiGLU), down + residual; h is updated in place."""
    att = layers[0]["o"].shape[1]
    rows = []
    for p in layers:
        rows += [
            stage_row(p["qkv"], h, qkv_out, None, p["g1"]),
            stage_row(p["o"], qkv_out[:att], h, h, None, RESIDUAL),
            stage_row(p["gate_up"], h, mid, None, p["g2"], SWIGLU),
            stage_row(p["down"], mid, h, h, None, RESIDUAL),
        ]
    return torch.tensor(rows, dtype=torch.int64, device="cuda")


def _engine_chain(layers, h):
    """The same layers through layers.gemv, one launch per GEMV (PDL where the GPU has it): the engine's b1 path."""
    from .gemv import gemv
    from .norm import RMSNorm

    att = layers[0]["o"].shape[1]
    for p in layers:
        q = gemv(h, p["qkv"], norm=RMSNorm(p["g1"], 1e-6, False, kernels=None))
        h = gemv(q[:, :att], p["o"], residual=h)
        m = gemv(h, p["gate_up"], swiglu=True, norm=RMSNorm(p["g2"], 1e-6, False, kernels=None))
        h = gemv(m, p["down"], residual=h)
    return h


def _graph_us(fn, runs: int = 30) -> list[float]:
    """Per-replay microseconds of a graph of fn()."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return times


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="0.6b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--launches", default="1,7,28,112", help="stages per launch to try, comma-separated")
    ap.add_argument("--tiles", default="132:8:1024:8,264:4:1024:4,396:4:1024:4,528:4:1024:4,528:2:1024:4",
                    help="programs:block_n:block_k:warps, comma-separated")  # fmt: skip
    a = ap.parse_args(argv)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = _layers(a.shape, a.layers, gen)
    hidden, qkv, _, mlp = SHAPES[a.shape]
    h0 = torch.randn(1, hidden, device="cuda", generator=gen).bfloat16()
    h = h0.clone()
    qkv_out = torch.empty(qkv, device="cuda", dtype=torch.bfloat16)
    mid = torch.empty(mlp, device="cuda", dtype=torch.bfloat16)
    table = _table(layers, h[0], qkv_out, mid)
    counts = torch.zeros(2, dtype=torch.int32, device="cuda")
    weight_bytes = sum(t.numel() * 2 for p in layers for t in p.values())
    print(f"{a.shape}: {a.layers} layers, {weight_bytes / 2**20:.0f} MiB of weights, {sms} SMs")

    ref = _engine_chain(layers[:2], h0.clone())
    engine = _graph_us(lambda: _engine_chain(layers, h0.clone()))
    print(f"{'one launch per GEMV (layers.gemv)':<44}{statistics.median(engine) / a.layers:9.2f} us/layer "
          f"(p90 {sorted(engine)[int(0.9 * len(engine))] / a.layers:.2f}), "
          f"{weight_bytes / statistics.median(engine) / 1e6:.2f} TB/s")  # fmt: skip
    barrier_only = torch.tensor([[0] * 5 + [0, 1, PLAIN]] * 112, dtype=torch.int64, device="cuda")
    for tiles in a.tiles.split(","):
        programs, block_n, block_k, warps = (int(v) for v in tiles.split(":"))
        fits, why = resident(programs, block_n, block_k, warps)
        if not fits:
            print(f"{tiles:<16} {why}: not all resident, skipped")
            continue
        h.copy_(h0)
        run(table[:8], counts, programs, block_n, block_k, warps)
        err = ((h.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        launch = (programs, block_n, block_k, warps)
        bars = _graph_us(lambda launch=launch: run(barrier_only, counts, *launch))
        line = f"{tiles:<16} {why}; 2-layer max rel diff vs layers.gemv {err:.1e}, "
        line += f"barrier {statistics.median(bars) / 112:.2f} us"
        if err > 2e-2:  # bf16 roundings differ in order only; anything larger is a wrong sum
            print(line + "  WRONG, not timed")
            continue
        print(line)
        for per in (int(v) for v in a.launches.split(",")):
            parts = [table[i : i + per] for i in range(0, table.shape[0], per)]
            times = _graph_us(lambda parts=parts, launch=launch: [run(t, counts, *launch) for t in parts])
            med, p90 = statistics.median(times), sorted(times)[int(0.9 * len(times))]
            print(f"  {per:>4} stages a launch{'':<20}{med / a.layers:9.2f} us/layer (p90 {p90 / a.layers:.2f}), "
                  f"{weight_bytes / med / 1e6:.2f} TB/s")  # fmt: skip


if __name__ == "__main__":
    main()
