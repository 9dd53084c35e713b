"""Probe: a side-stream prefetcher kernel that keeps the next weights in L2, paced by the chain's progress."""

import statistics
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from pocketlab.layers import gemv, gemv_tma, pdl
from pocketlab.layers.gemv_tma import ONE_ROW_RING, ring_sums
from pocketlab.layers.invariant.matmul import PLAIN, RESIDUAL, SWIGLU, finish
from pocketlab.layers.norm import RMSNorm, norm_flavour
from pocketlab.layers.pdl import wait_then_release
from pocketlab.layers.prefetch import bulk_prefetch


@triton.jit
def _gemv_mark(x_ptr, w_desc, b_ptr, y_ptr, res_ptr, g_ptr, eps, N, K, prog_ptr, mark, HAS_BIAS: tl.constexpr,
               EPILOGUE: tl.constexpr, NORM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               STAGES: tl.constexpr, MARK: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    n0 = tl.program_id(0) * BLOCK_N
    first = w_desc.load([n0, 0])
    first_up = w_desc.load([n0 + N, 0]) if EPILOGUE == 2 else first
    wait_then_release(PDL)
    if MARK:
        if tl.program_id(0) == 0:
            tl.store(prog_ptr, mark)
    total, total_up, squares = ring_sums(w_desc, n0, n0 + N, x_ptr, g_ptr, K, first, first_up, NORM, EPILOGUE == 2,
                                         BLOCK_N, BLOCK_K, STAGES)  # fmt: skip
    inv_rms = tl.rsqrt(squares / K + eps) if NORM else 1.0
    n, m = n0 + tl.arange(0, BLOCK_N), tl.arange(0, 1)
    y = finish((total * inv_rms)[None, :], (total_up * inv_rms)[None, :], b_ptr, res_ptr, m, n, m < 1, n < N, 0,
               y_ptr.dtype.element_ty, HAS_BIAS, EPILOGUE)  # fmt: skip
    tl.store(y_ptr + n[None, :], y, mask=(n < N)[None, :])


@triton.jit
def _prefetcher(addr_ptr, bytes_ptr, prog_ptr, S, LEAD: tl.constexpr, LANES: tl.constexpr):
    p, P = tl.program_id(0), tl.num_programs(0)
    lane = tl.arange(0, LANES)
    for s in range(S):
        if s >= LEAD:
            seen = tl.load(prog_ptr, volatile=True)
            while seen < s - LEAD:
                seen = tl.load(prog_ptr, volatile=True)
        base = tl.load(addr_ptr + s)
        nbytes = tl.load(bytes_ptr + s)
        piece = tl.cdiv(tl.cdiv(nbytes, P * LANES), 16) * 16
        start = (p * LANES + lane).to(tl.int64) * piece
        size = tl.minimum(tl.maximum(nbytes - start, 0), piece).to(tl.int32)
        bulk_prefetch(base + start, size)


def mark_launch(x, w, y, epilogue, res, norm, prog, mark):
    r = ONE_ROW_RING
    N, K = y.shape[1], x.shape[1]
    desc = TensorDescriptor.from_tensor(w, block_shape=[r.block_n, r.block_k])
    _gemv_mark[(triton.cdiv(N, r.block_n),)](
        x, desc, y, y, y if res is None else res, y if norm is None else norm.weight, 0.0 if norm is None else norm.eps,
        N, K, prog, mark, HAS_BIAS=False, EPILOGUE=epilogue, NORM=norm_flavour(norm), BLOCK_N=r.block_n,
        BLOCK_K=r.block_k, STAGES=r.stages, MARK=prog is not None, num_warps=r.num_warps, **pdl.launch(x.device))
    return y


SHAPES = {  # hidden, q width, kv width, intermediate, layers
    "0.6b": (1024, 2048, 1024, 3072, 28),
    "1.7b": (2048, 2048, 1024, 6144, 28),
}


def build(name, gen):
    d, q, kv, inter, L = SHAPES[name]
    def w(n, k):
        return (torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).bfloat16()
    layers = []
    for _ in range(L):
        layers.append(dict(qkv=w(q + 2 * kv, d), o=w(d, q), gate_up=w(2 * inter, d), down=w(d, inter),
                           n1=RMSNorm(1 + 0.1 * torch.randn(d, device="cuda", generator=gen).bfloat16(), 1e-6),
                           n2=RMSNorm(1 + 0.1 * torch.randn(d, device="cuda", generator=gen).bfloat16(), 1e-6)))
    return layers


def chain(layers, h, prog, mode, lead, programs, spin_ns=0):
    """One step: qkv(norm) -> o+res -> gate_up(norm, swiglu) -> down+res per layer. mode: 'real' (gemv.gemv),
    'mark' (probe kernel with marks), 'pf' (marks + prefetcher)."""
    order = [w for lay in layers for w in (lay["qkv"], lay["o"], lay["gate_up"], lay["down"])]
    if mode == "pf":
        addr = torch.tensor([t.data_ptr() for t in order], dtype=torch.int64, device="cuda")
        nbytes = torch.tensor([t.numel() * 2 // 16 * 16 for t in order], dtype=torch.int64, device="cuda")
    side = torch.cuda.Stream()

    def step():
        x = h
        if mode == "pf":
            prog.fill_(-1)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                _prefetcher[(programs,)](addr, nbytes, prog, len(order), LEAD=lead, LANES=128, num_warps=4)
        j = 0
        for lay in layers:
            q = lay["qkv"].shape[0]
            if mode == "real":
                a = gemv.gemv(x, lay["qkv"], norm=lay["n1"])
                x = gemv.gemv(a[:, : lay["o"].shape[1]], lay["o"], residual=x)
                g = gemv.gemv(x, lay["gate_up"], swiglu=True, norm=lay["n2"])
                x = gemv.gemv(g, lay["down"], residual=x)
            else:
                p = prog if mode in ("mark", "pf") else None
                a = mark_launch(x, lay["qkv"], x.new_empty(1, q), PLAIN, None, lay["n1"], p, j)
                x = mark_launch(a[:, : lay["o"].shape[1]], lay["o"], x.new_empty(1, x.shape[1]), RESIDUAL, x, None, p, j + 1)
                g = mark_launch(x, lay["gate_up"], x.new_empty(1, lay["gate_up"].shape[0] // 2), SWIGLU, None, lay["n2"], p, j + 2)
                x = mark_launch(g, lay["down"], x.new_empty(1, x.shape[1]), RESIDUAL, x, None, p, j + 3)
            j += 4
        if mode == "pf":
            torch.cuda.current_stream().wait_stream(side)
        return x

    out = step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(30):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    ref = out.clone()
    return statistics.median(times), min(times), max(times), ref


LEADS = [int(v) for v in __import__('os').environ.get('LEADS', '1,2,3').split(',')]
PROGRAMS = [int(v) for v in __import__('os').environ.get('PROGS', '16,32,64').split(',')]


def main():
    names = sys.argv[1:] or ["0.6b"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    prog = torch.full((1,), -1, dtype=torch.int32, device="cuda")
    print(torch.cuda.get_device_name())
    for name in names:
        layers = build(name, gen)
        h = torch.randn(1, SHAPES[name][0], device="cuda", generator=gen).bfloat16()
        rows = []
        base = chain(layers, h, prog, "real", 0, 0)
        rows.append(("real", base))
        rows.append(("mark", chain(layers, h, prog, "mark", 0, 0)))
        for lead in LEADS:
            for programs in PROGRAMS:
                rows.append((f"pf lead={lead} P={programs}", chain(layers, h, prog, "pf", lead, programs)))
        for label, (med, lo, hi, out) in rows:
            same = torch.equal(out, base[3])
            print(f"{name} {label:<22} median {med:8.1f} us  min {lo:8.1f}  max {hi:8.1f}  "
                  f"{base[0] / med:.3f}x  same={same}", flush=True)
        del layers
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
