"""CUDA-graph replay of forward steps (a decode step, a short prompt's forward, a speculative verify step) over
static buffers.

Python launches hundreds of small kernels per step; at batch 1 that, not memory, bounds decode speed, and the
same host work is most of a short prompt's forward. Each (step, batch bucket, tokens per row, key-length bucket)
is captured once; a call copies its inputs into the static buffer and replays the smallest graph that fits.
Filler rows run on the scratch slot.
"""

from __future__ import annotations

import bisect
import contextlib
import warnings
from dataclasses import dataclass
from typing import NamedTuple, cast

import numpy as np
import torch

from .cache import linear_state_bytes
from .config import DTYPES
from .forward import ForwardContext, Run
from .layers import fused

SMALLEST_PROMPT_BUCKET = 16  # a graphed prompt forward runs 16, 32, 64, ... tokens per row
# A hybrid's decode step launched ahead stores its Gated DeltaNet states in rows aside, copied into the slots when
# the next call takes it: at most this many bytes a step, so the copy stays well under the host time it hides.
ASIDE_BYTES = 64 << 20


def token_buckets(max_tokens: int) -> list[int]:
    """Tokens per row of the prompt graphs: powers of two from SMALLEST_PROMPT_BUCKET up to max_tokens."""
    sizes, n = [], SMALLEST_PROMPT_BUCKET
    while n <= max_tokens:
        sizes.append(n)
        n *= 2
    return sizes


def batch_buckets(options) -> list[int]:
    """Rows of the graphs: graph_batch_sizes below max_slots, and max_slots."""
    return sorted({b for b in options.graph_batch_sizes if b < options.max_slots} | {options.max_slots})


def aside_rows(cfg, options) -> int:
    """Batch rows whose Gated DeltaNet states a decode step launched ahead can store aside: the largest batch bucket
    within ASIDE_BYTES where the engine launches steps ahead (0: none, or no Gated DeltaNet layers)."""
    if not (cfg.linear_layers and options.launches_ahead(cfg)):
        return 0
    per_row = linear_state_bytes(cfg, DTYPES[options.dtype].itemsize)
    return max((b for b in batch_buckets(options) if b * per_row <= ASIDE_BYTES), default=0)


def prompt_shapes(batch_sizes: list[int], max_tokens: int) -> list[tuple[int, int]]:
    """(rows, token bucket) of every prompt graph: rows x bucket at most max_tokens (prefill_graph_tokens)."""
    return [(b, T) for b in batch_sizes for T in token_buckets(max_tokens // b)]


def bucket(sizes: list[int], n: int) -> int | None:
    """The smallest of the ascending `sizes` that holds n (None: none does)."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def key_buckets(max_seq_len: int, smallest: int = 128) -> list[int]:
    """Powers of two up to max_seq_len: attention reads at most ~2x the live keys."""
    sizes, n = [], smallest
    while n < max_seq_len:
        sizes.append(n)
        n *= 2
    return sizes + [max_seq_len]


@dataclass
class StaticInputs:
    """A captured step's inputs: named views into ONE [T + 3, B] long buffer (T token rows, then slot ids, start
    positions, lengths), so a replay loads them with one host-to-device copy, from a pinned host copy of the buffer
    without waiting for it (`copied` marks when the GPU has read it). The graph reads them: they must outlive it."""

    buffer: torch.Tensor
    tokens: torch.Tensor  # [B, T] (a transposed view)
    slot_ids: torch.Tensor  # [B]
    start: torch.Tensor  # [B]
    lengths: torch.Tensor  # [B]
    host: torch.Tensor  # the buffer's host side: pinned where the buffer is on a GPU
    copied: torch.cuda.Event | None  # on a GPU: recorded after each copy (synchronizing one never recorded returns)

    @classmethod
    def allocate(cls, rows: int, tokens: int, scratch_slot: int, device) -> StaticInputs:
        """Buffers for `rows` runs of `tokens` tokens, every row a filler run on the scratch slot."""
        buffer = torch.zeros(tokens + 3, rows, dtype=torch.long, device=device)
        host = torch.zeros_like(buffer, device="cpu", pin_memory=buffer.is_cuda)
        copied = torch.cuda.Event() if buffer.is_cuda else None
        slot_ids, start, lengths = buffer[tokens:]
        inputs = cls(buffer, buffer[:tokens].t(), slot_ids, start, lengths, host, copied)
        inputs.slot_ids.fill_(scratch_slot)
        inputs.lengths.fill_(tokens)
        return inputs

    def load(self, runs: list[Run], scratch_slot: int, real_lengths: bool) -> None:
        """Copy `runs` in, each padded with token 0 to T (its length T, or its own with real_lengths); the rows
        past them run T tokens on the scratch slot."""
        rows, T = self.tokens.shape
        if len(runs) > rows or any(len(run.tokens) > T for run in runs):
            raise ValueError(
                f"these inputs hold at most {rows} runs of {T} tokens; got {[len(r.tokens) for r in runs]}"
            )
        pad = rows - len(runs)
        columns = [
            run.tokens + [0] * (T - len(run.tokens)) + [run.slot, run.start, len(run.tokens) if real_lengths else T]
            for run in runs
        ] + [[0] * T + [scratch_slot, 0, T]] * pad
        if self.copied is not None:  # the GPU may still be reading the last step's inputs from `host`
            self.copied.synchronize()
        self.host.numpy()[:] = np.array(columns, dtype=np.int64).T
        self.buffer.copy_(self.host, non_blocking=True)
        if self.copied is not None:
            self.copied.record()

    def context(self, kv_len: int, scratch_slot: int) -> ForwardContext:
        """A context over these buffers (hooks off); kv_len: the key bucket the graph attends over."""
        return ForwardContext(
            tokens=self.tokens,
            slot_ids=self.slot_ids,
            start=self.start,
            lengths=self.lengths,
            kv_len=kv_len,
            scratch_slot=scratch_slot,
        )


@dataclass
class Ahead:
    """A decode step launched before its call (StepGraphs.launch_ahead): it serves a call that runs the same slots
    in the same order from the same positions, fed the tokens it was fed, where no slot's history changed since
    but for the one extend of the step that launched it."""

    runs: list[tuple[int, int]]  # (slot, start) per row
    changes: list[int]  # each slot's SlotState.changes at the launch
    outputs: tuple[torch.Tensor, torch.Tensor]  # its [n, vocab] logits and n greedy tokens, out of the graphs' pool
    back: int  # the pinned buffer its greedy tokens come back in
    aside: torch.Tensor | None  # the slots [n] (device) whose Gated DeltaNet states it stored aside, if any
    tokens: list[int] | None = None  # what it was fed: the tokens the launching step returned

    def serves(self, runs: list[Run], cache) -> bool:
        return (
            [(r.slot, r.start) for r in runs] == self.runs
            and [r.tokens[0] for r in runs] == self.tokens
            and [cache.slots[r.slot].changes for r in runs] == [c + 1 for c in self.changes]
        )


class Captured(NamedTuple):
    """One captured step: the graph, the inputs it reads and the outputs it writes."""

    graph: torch.cuda.CUDAGraph
    inputs: StaticInputs
    outputs: object  # what the captured step returned: static tensors the replays overwrite


class StepGraphs:
    def __init__(self, model, cache, options):
        self.model, self.cache = model, cache
        self.batch_sizes, self.key_sizes = batch_buckets(options), key_buckets(options.max_seq_len)
        self.prefill_tokens = options.prefill_graph_tokens  # prompt forwards of at most this many padded tokens
        # every prompt graph writes its hidden states into the first rows x bucket rows of this one buffer
        shape, dtype = (self.prefill_tokens, model.cfg.hidden_size), options.torch_dtype
        graphed = token_buckets(self.prefill_tokens)
        self.prompt_hidden = torch.empty(shape, dtype=dtype, device=options.device) if graphed else None
        # compiled elementwise chains round differently from the eager ones prompts run: not batch invariant
        self.device, self.compile = options.device, options.compile and not options.batch_invariant
        self.graphs: dict[tuple, Captured] = {}
        self.failed: dict[tuple, str] = {}  # key -> why its capture failed twice (those steps run eagerly)
        self.pool = None  # one memory pool for all of this engine's graphs, made at the first capture
        self.captures = 0  # capture attempts (replays' and rollbacks'): after warm-up this stays put
        self.last: Captured | None = None  # the graph replayed last (tools.profile times it alone)
        # a decode step's greedy tokens reach the host through a pinned buffer, ahead of its logits' copy: two, so a
        # step launched ahead reads back into one while the host waits on the other
        on_gpu = torch.device(options.device).type == "cuda"
        self.greedy_host = [torch.zeros(self.batch_sizes[-1], dtype=torch.long, pin_memory=on_gpu) for _ in "ab"]
        self.greedy_copied = [torch.cuda.Event() if on_gpu else None for _ in "ab"]
        self.ahead: Ahead | None = None  # the decode step launched before its call, if any
        cache.allocate_aside(aside_rows(model.cfg, options))  # where a hybrid's launched step stores its states

    def logits(self, runs: list[Run], ahead: bool = False) -> tuple[torch.Tensor, list[int] | None]:
        """One decode step (runs of one token each): its [B, vocab] float32 logits and their argmax per row, the
        greedy tokens (None where the step ran eagerly). Replayed, the graph computes the argmax too, and the host
        waits for those B tokens alone, not for the logits' copy out of the graph's buffer queued after them.
        `ahead`: before that wait, launch the next step of these slots, fed these tokens on the device
        (`launch_ahead`); a step launched so by the call before serves this one if it ran exactly these runs."""
        launched, self.ahead = self.ahead, None  # the next decode call takes it or no call does: used or gone
        n = len(runs)
        if launched is not None and launched.serves(runs, self.cache):
            (logits, argmax), back = launched.outputs, launched.back
            if launched.aside is not None:  # its states join its slots', before anything reads them
                self.cache.take_aside(launched.aside)
        else:
            out, back = self.replay("decode", self._decode, runs), 0
            if out is None:
                return self._decode(ForwardContext.build(runs, self.cache.scratch, self.device))[0], None
            self._read_back(out[1], n, back)
            logits, argmax = out[0][:n].clone(), out[1]  # the logits out before the next replay, behind the tokens
        if ahead:
            self.ahead = self.launch_ahead(runs, argmax, 1 - back)
        tokens = self._tokens(n, back)
        if self.ahead is not None:
            self.ahead.tokens = tokens
        return logits, tokens

    def launch_ahead(self, runs: list[Run], argmax: torch.Tensor, back: int) -> Ahead | None:
        """Launch the decode step after `runs` on the same slots, each row's token from `argmax` (a step's greedy
        tokens) copied on the device, so the GPU goes on while the host returns this step's tokens and the next
        call comes. Its tokens come back through pinned buffer `back`. Nothing visible changes: it writes each
        slot's K/V one position past its history, where no key is read until a step writes it again, the graph's
        outputs, which it copies out at once (the graphs share one pool: a later replay of any of them may reuse
        that memory before the step is served), and a hybrid's Gated DeltaNet states aside (the cache's `aside`),
        which join the slots' only if the step is served. None past max_seq_len, past the rows aside, or where the
        capture fails."""
        n, nxt = len(runs), [Run(r.slot, r.start + 1, [0]) for r in runs]
        b, kv = bucket(self.batch_sizes, n), bucket(self.key_sizes, max(r.start for r in nxt) + 1)
        aside = bool(self.model.cfg.linear_layers)
        if kv is None or b is None or (aside and b > self.cache.aside_rows):
            return None
        captured = (
            self.ensure(("decode_aside", b, 1, kv), self._decode_aside)
            if aside
            else self.graphs.get(("decode", b, 1, kv))
        )
        if captured is None:
            return None
        captured.inputs.load(nxt, self.cache.scratch, False)
        captured.inputs.tokens[:n, 0].copy_(argmax[:n])
        captured.graph.replay()
        self.last = captured
        logits, argmax = cast(tuple[torch.Tensor, torch.Tensor], captured.outputs)  # a decode step's
        outputs = (logits[:n].clone(), argmax[:n].clone())  # out of the pool before any other replay
        self._read_back(outputs[1], n, back)
        changes = [self.cache.slots[r.slot].changes for r in runs]
        slots = captured.inputs.slot_ids[:n] if aside else None  # read by take_aside before any later load
        return Ahead([(r.slot, r.start) for r in nxt], changes, outputs, back, slots)

    def _read_back(self, argmax: torch.Tensor, n: int, back: int) -> None:
        """Queue the copy of a step's n greedy tokens into pinned buffer `back`."""
        self.greedy_host[back][:n].copy_(argmax[:n], non_blocking=True)
        if (event := self.greedy_copied[back]) is not None:
            event.record()

    def _tokens(self, n: int, back: int) -> list[int]:
        if (event := self.greedy_copied[back]) is not None:
            event.synchronize()
        return self.greedy_host[back][:n].tolist()

    def _decode(self, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.logits_and_argmax(self.model.forward(ctx, self.cache)[:, 0])

    def _decode_aside(self, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step whose Gated DeltaNet layers store their states aside (a step launched ahead at a hybrid)."""
        ctx.states_aside = True
        return self._decode(ctx)

    def ahead_keys(self) -> list[tuple]:
        """Every key a hybrid's step launched ahead can replay (its batch within the rows aside): warm-up captures
        them."""
        return [key for key in self.keys("decode_aside", 1) if key[1] <= self.cache.aside_rows]

    def prefill(self, runs: list[Run]) -> torch.Tensor | None:
        """[B, T, hidden] final-normed hidden states of the runs' tokens from a graph whose rows run T, the token
        bucket of the longest run (shorter runs masked by their lengths): a view of `prompt_hidden`, which the next
        replay overwrites. None where this forward is not graphed (rows x bucket over prefill_tokens, a bucket past
        the context's end, or a capture that failed): the caller runs it eagerly."""
        T = bucket(token_buckets(self.prefill_tokens), max(len(run.tokens) for run in runs))
        b = bucket(self.batch_sizes, len(runs))
        assert b is not None
        if T is None or b * T > self.prefill_tokens or max(run.start for run in runs) + T > self.key_sizes[-1]:
            return None
        out = self.replay("prefill", self._prefill, runs, real_lengths=True, tokens=T)
        return None if out is None else out[: len(runs)]

    def _prefill(self, ctx: ForwardContext) -> torch.Tensor:
        b, T = ctx.tokens.shape
        # the eager prompt's kernels (compiled only from LARGE on): no torch.compile graph for a new process to trace
        with fused.compiled_kernels(self.compile, min_elements=fused.LARGE):
            hidden = self.model.forward(ctx, self.cache)
        assert self.prompt_hidden is not None  # only prompt graphs run this: they exist only when the buffer does
        return self.prompt_hidden[: b * T].view(b, T, -1).copy_(hidden)

    @contextlib.contextmanager
    def prompts_eager(self):
        """Every prompt forward inside runs eagerly (warm-up compiles the kernels of pieces no graph takes)."""
        tokens, self.prefill_tokens = self.prefill_tokens, 0
        try:
            yield
        finally:
            self.prefill_tokens = tokens

    def prefill_keys(self) -> list[tuple]:
        """Every key a prompt forward can replay: warm-up captures them all."""
        shapes = prompt_shapes(self.batch_sizes, self.prefill_tokens)
        return [("prefill", b, T, kv) for b, T in shapes for kv in self.key_sizes if kv >= T]

    def replay(self, name: str, step, runs: list[Run], real_lengths: bool = False, beyond: int = 0, tokens: int = 0):
        """step(ctx)'s outputs (static tensors, rows past len(runs) are filler) for `runs`. Every row runs T = the
        longest run's tokens (or `tokens`, at least that), shorter runs padded with token 0: treated as real
        (lengths T: the caller ignores what they produce, and every position written must fit in the slot), or,
        with real_lengths, masked by each run's own length. `beyond`: positions past the runs that the step
        also writes (the key bucket must hold them). None where this shape's graph cannot be captured: the
        caller runs the step eagerly."""
        B, T = len(runs), max(tokens, *(len(run.tokens) for run in runs))
        b = bucket(self.batch_sizes, B)
        kv = bucket(self.key_sizes, max(run.start for run in runs) + T + beyond)
        captured = self.ensure((name, b, T, kv), step)
        if captured is None:
            return None
        captured.inputs.load(runs, self.cache.scratch, real_lengths)
        captured.graph.replay()
        self.last = captured
        return captured.outputs

    def ensure(self, key: tuple, step) -> Captured | None:
        """The graph of `key` = (name, batch bucket, tokens per row, key bucket), captured now if it is new;
        None where its capture failed."""
        if key not in self.graphs and key not in self.failed:
            self._capture_with_retry(key, step)
        return self.graphs.get(key)

    def keys(self, name: str, tokens: int, beyond: int = 0) -> list[tuple]:
        """Every key a replay of `name` with `tokens` per row (and `beyond`) can pick: warm-up captures them all."""
        return [(name, b, tokens, kv) for b in self.batch_sizes for kv in self.key_sizes if kv >= tokens + beyond]

    def capture(self, fn):
        """(graph, outputs) of fn() captured in this engine's pool, after one warm-up run outside the graph
        (cuBLAS handles, compilation). Every tensor the graph reads must outlive it: keep them with it."""
        self.captures += 1
        return self.record(fn)

    def record(self, fn):
        """capture()'s CUDA part (the CPU tests replace it)."""
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
        """A capture that fails is reported and tried once more; after a second failure the shape runs eagerly
        from then on (`failed` says why)."""
        for attempt in ("retrying", "that shape runs eagerly"):
            try:
                self._capture(key, step)
                return True
            except RuntimeError as e:  # torch.AcceleratorError is a RuntimeError
                why = f"{type(e).__name__}: {str(e).splitlines()[0]}"
                # an error inside a capture can leave its pool taking allocations ("already recording to
                # mempool_id" on the next capture into it, seen on the H200): the retry and later captures take
                # a fresh pool
                self.pool = None
                warnings.warn(f"CUDA graph capture of {key} failed ({why}); {attempt}", RuntimeWarning, stacklevel=2)
        self.failed[key] = why
        return False

    def _capture(self, key: tuple, step) -> None:
        _, b, T, kv = key
        inputs = StaticInputs.allocate(b, T, self.cache.scratch, self.device)
        ctx = inputs.context(kv, self.cache.scratch)
        graph, out = self.capture(lambda: step(ctx))
        self.graphs[key] = Captured(graph, inputs, out)
