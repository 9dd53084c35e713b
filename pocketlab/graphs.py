"""CUDA-graph replay of forward steps (a decode step, a speculative verify step) over static buffers.

Python launches hundreds of small kernels per step; at batch 1 that, not memory, bounds decode speed.
Each (step, batch bucket, tokens per row, key-length bucket) is captured once; a call copies its inputs
into the static buffer and replays the smallest graph that fits. Filler rows run on the scratch slot.
"""

from __future__ import annotations

import bisect
import warnings

import torch

from .batch import ForwardBatch
from .layers import fused


def key_buckets(max_seq_len: int, smallest: int = 128) -> list[int]:
    """Powers of two up to max_seq_len: attention reads at most ~2x the live keys."""
    sizes, n = [], smallest
    while n < max_seq_len:
        sizes.append(n)
        n *= 2
    return sizes + [max_seq_len]


class StepGraphs:
    def __init__(self, model, cache, options):
        self.model, self.cache = model, cache
        sizes = sorted({b for b in options.graph_batch_sizes if b < options.max_slots} | {options.max_slots})
        self.batch_sizes, self.key_sizes = sizes, key_buckets(options.max_seq_len)
        self.device, self.compile = options.device, options.compile
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, object]] = {}
        self.failed: dict[tuple, str] = {}  # key -> why its capture failed twice (those steps run eagerly)
        self.pool = None  # one memory pool for all of this engine's graphs, made at the first capture

    def logits(self, seqs: list[tuple[int, int, list[int]]]) -> torch.Tensor:
        """[B, vocab] float32 logits of one decode step; seqs hold (slot, position, [token])."""
        out = self.replay("decode", self._decode, seqs)
        if out is None:
            batch = ForwardBatch.build(seqs, self.cache.scratch, self.device)
            return self._decode(batch)
        return out[: len(seqs)].clone()  # the next replay overwrites it

    def _decode(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model.logits(self.model.forward(batch, self.cache)[:, 0])

    def replay(
        self, name: str, step, seqs: list[tuple[int, int, list[int]]], real_lengths: bool = False, beyond: int = 0
    ):
        """step(batch)'s outputs (static tensors, rows past len(seqs) are filler) for seqs (slot, position,
        tokens). Every row runs T = the longest run's tokens, shorter runs padded with token 0: treated as real
        (lengths T: the caller ignores what they produce, and every position written must fit in the slot), or,
        with real_lengths, masked by each run's own length. `beyond`: positions past the runs that the step
        also writes (the key bucket must hold them). None where this shape's graph cannot be captured: the
        caller runs the step eagerly."""
        B, T = len(seqs), max(len(t) for _, _, t in seqs)
        b = self.batch_sizes[bisect.bisect_left(self.batch_sizes, B)]
        kv = self.key_sizes[bisect.bisect_left(self.key_sizes, max(p for _, p, _ in seqs) + T + beyond)]
        key = (name, b, T, kv)
        if key in self.failed:
            return None
        if key not in self.graphs and not self._capture_with_retry(key, step):
            return None
        graph, inputs, out = self.graphs[key]
        pad = b - B
        rows = [t + [0] * (T - len(t)) for _, _, t in seqs] + [[0] * T] * pad
        lengths = [len(t) if real_lengths else T for _, _, t in seqs] + [T] * pad
        inputs.copy_(
            torch.tensor(
                [list(col) for col in zip(*rows)]
                + [[s for s, _, _ in seqs] + [self.cache.scratch] * pad, [p for _, p, _ in seqs] + [0] * pad, lengths]
            )
        )  # one host-to-device copy
        graph.replay()
        return out

    def capture(self, fn):
        """(graph, outputs) of fn() captured in this engine's pool, after one warm-up run outside the graph
        (cuBLAS handles, compilation). Every tensor the graph reads must outlive it: keep them with it."""
        self.pool = self.pool or torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with fused.compiled_kernels(self.compile):
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = fn()
        return graph, out

    def _capture_with_retry(self, key: tuple, step) -> bool:
        """A capture that fails (seen once in the CUDA test run, verify step, cause not yet known) is reported and
        tried once more; after a second failure the shape runs eagerly from then on (`failed` says why)."""
        for attempt in ("retrying", "that shape runs eagerly"):
            try:
                self._capture(key, step)
                return True
            except RuntimeError as e:  # torch.AcceleratorError is a RuntimeError
                why = f"{type(e).__name__}: {str(e).splitlines()[0]}"
                warnings.warn(f"CUDA graph capture of {key} failed ({why}); {attempt}", RuntimeWarning)
        self.failed[key] = why
        return False

    def _capture(self, key: tuple, step) -> None:
        # Rows: tokens (T of them, one row per position), slot ids, start positions, lengths (all T). One static
        # buffer that the graph reads and that outlives it; filler rows run on the scratch slot.
        _, b, T, kv = key
        inputs = torch.zeros(T + 3, b, dtype=torch.long, device=self.device)
        inputs[T], inputs[T + 2] = self.cache.scratch, T
        batch = ForwardBatch(
            tokens=inputs[:T].t(),
            slot_ids=inputs[T],
            start=inputs[T + 1],
            lengths=inputs[T + 2],
            kv_len=kv,
            scratch_slot=self.cache.scratch,
        )
        graph, out = self.capture(lambda: step(batch))
        self.graphs[key] = (graph, inputs, out)
