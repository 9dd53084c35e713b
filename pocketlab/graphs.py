"""CUDA-graph replay of one decode step (forward + logits) over static buffers.

Python launches hundreds of small kernels per step; at batch 1 that, not memory, bounds decode speed.
Each (batch bucket, key-length bucket) is captured once; a step copies its inputs into the static
buffers and replays the smallest graph that fits. Filler rows run on the scratch slot.
"""
from __future__ import annotations

import bisect

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


class DecodeGraphs:
    def __init__(self, model, cache, options):
        self.model, self.cache = model, cache
        sizes = sorted({b for b in options.graph_batch_sizes if b < options.max_slots} | {options.max_slots})
        self.batch_sizes, self.key_sizes = sizes, key_buckets(options.max_seq_len)
        self.device, self.compile = options.device, options.compile
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def logits(self, seqs: list[tuple[int, int, list[int]]]) -> torch.Tensor:
        """[B, vocab] float32 logits of one decode step; seqs hold (slot, position, [token])."""
        B = len(seqs)
        b = self.batch_sizes[bisect.bisect_left(self.batch_sizes, B)]
        kv = self.key_sizes[bisect.bisect_left(self.key_sizes, max(p for _, p, _ in seqs) + 1)]
        graph, inputs, out = self.graphs.get((b, kv)) or self._capture(b, kv)
        pad = b - B
        inputs[:3].copy_(torch.tensor([[t[0] for _, _, t in seqs] + [0] * pad,
                                       [s for s, _, _ in seqs] + [self.cache.scratch] * pad,
                                       [p for _, p, _ in seqs] + [0] * pad]))  # one host-to-device copy
        graph.replay()
        return out[:B].clone()  # the static buffer is overwritten by the next replay

    def _step(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model.logits(self.model.forward(batch, self.cache)[:, 0])

    def _capture(self, b: int, kv: int):
        # Rows: tokens, slot ids, start positions, lengths (all 1). One static buffer that the graph reads and
        # that outlives it (a tensor freed after capture would be reused under the graph); filler: scratch slot.
        inputs = torch.zeros(4, b, dtype=torch.long, device=self.device)
        inputs[1], inputs[3] = self.cache.scratch, 1
        batch = ForwardBatch(tokens=inputs[0, :, None], slot_ids=inputs[1], start=inputs[2], lengths=inputs[3],
                             kv_len=kv, scratch_slot=self.cache.scratch)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with fused.compiled_kernels(self.compile):
            with torch.cuda.stream(side):  # warm-up outside the graph (cuBLAS handles, compilation)
                self._step(batch)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self._step(batch)
        self.graphs[(b, kv)] = (graph, inputs, out)
        return self.graphs[(b, kv)]
