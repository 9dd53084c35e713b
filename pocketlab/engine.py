"""QwenEngine: the slot API. Every slot owns its sequence; batch calls run ONE forward for all slots."""

from __future__ import annotations

import dataclasses
import warnings
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import cast

import torch

from . import compile_events, text
from .cache import SlotCache, Snapshot, model_id
from .config import EngineOptions, ModelConfig, generation_defaults
from .forward import ForwardContext, Run
from .generate import generate as continuous_batching
from .graphs import StepGraphs
from .layers.fused import LARGE, compiled_kernels
from .loader import load_weights, optional_mtp, stack_experts, validate_weights
from .memory import MemoryPlan, resolve
from .models import build_model
from .parallel.comm import gather_snapshot, shard_for
from .prefix_cache import PrefixCache
from .requests import BatchDecodeResult, BatchedRequest, BatchPrefillResult, ForwardResult, Refusal
from .sampling import GREEDY, SamplingParams, penalize, sample
from .speculative import Speculator
from .warmup import WarmupReport, warm_up


def plan_pieces(start: int, end: int, chunk: int, stride: int = 0) -> list[tuple[int, int]]:
    """[lo, hi) prefill pieces covering start..end, at most `chunk` tokens each and, when stride > 0, never
    crossing a multiple of `stride` (so the state at every stride multiple exists between two pieces)."""
    pieces, lo = [], start
    while lo < end:
        hi = min(lo + chunk, end)
        if stride:
            hi = min(hi, (lo // stride + 1) * stride)
        pieces.append((lo, hi))
        lo = hi
    return pieces


class QwenEngine:
    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        options: EngineOptions | None = None,
        tokenizer=None,
        generation: dict | None = None,
    ):
        """tokenizer: a transformers tokenizer for the text API (from_pretrained loads the folder's); generation:
        SamplingParams fields the text API uses by default (from_pretrained reads generation_config.json)."""
        if tokenizer is not None and len(tokenizer) > cfg.vocab_size:
            raise ValueError(
                f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary holds {cfg.vocab_size}: "
                "tokenizer and weights are from different checkpoints"
            )
        self.tokenizer, self.generation = tokenizer, dict(generation or {})
        options = options or EngineOptions()
        self.cfg = cfg = optional_mtp(cfg, weights, options.speculative_tokens)
        # tensor parallelism: this process's shard (Shard() on one device) and the config of its part of the model
        self.shard, options = shard_for(options)
        local = self.shard.local_config(cfg)
        device = torch.device(options.device).type
        resident = bool(weights) and all(t.device.type == device for t in weights.values())
        self.memory: MemoryPlan = resolve(cfg, options, weights_resident=resident)  # refuses what cannot fit
        self.options = self.memory.options  # max_slots="auto" resolved
        whole = "cpu" if self.shard.world > 1 else self.options.device  # sliced on the host, then moved
        weights = validate_weights(stack_experts(dict(weights)), cfg, whole, self.options.torch_dtype)
        self.model_id = model_id(cfg, weights)  # snapshots carry it: one restores only into its own model
        if self.shard.world > 1:
            weights = validate_weights(
                self.shard.weights(weights, cfg), local, self.options.device, self.options.torch_dtype
            )
        self.model = build_model(local, weights, self.options)
        self.cache = SlotCache(local, self.options)
        self.cache.model_id = self.model_id
        self.prefix = PrefixCache(self.cache, self.options) if self.options.prefix_cache else None
        self.num_slots = self.options.slot_count
        self.forward_count = 0  # model forwards run; batch calls must add exactly one
        use_graphs = self.options.cuda_graphs and torch.device(self.options.device).type == "cuda"
        if use_graphs and self.model.syncs_with_host:  # every capture would fail: say so once, not per shape
            warnings.warn(
                "CUDA graphs off: the MoE experts' torch path reads expert ids on the host in this dtype "
                "(grouped_mm takes 16-bit inputs on CUDA); moe_kernel='triton' or a 16-bit dtype keeps them",
                RuntimeWarning,
                stacklevel=2,
            )
            use_graphs = False
        self.graphs = StepGraphs(self.model, self.cache, self.options) if use_graphs else None
        self.speculator = Speculator(self) if self.options.speculative_tokens else None  # drafts + one verify forward
        # a decode step may launch the next (decodes_ahead) where, left unserved, it changes nothing a call sees
        self.ahead_allowed = self.options.launches_ahead(cfg)
        if device == "cuda":  # the interpreter compiles nothing: on the CPU there is nothing to count
            compile_events.track_triton()
        self.warmup_report: WarmupReport | None = self.warmup() if self.options.warmup else None

    @classmethod
    def from_pretrained(cls, path: str | Path, options: EngineOptions | None = None) -> QwenEngine:
        options = options or EngineOptions()
        cfg, generation = ModelConfig.from_pretrained(path), generation_defaults(path)
        options = resolve(cfg, options).options  # before reading any weights: refuse what cannot fit
        device = "cpu" if options.tensor_parallel > 1 else options.device  # each rank moves only its shard
        weights = load_weights(path, cfg, device, options.torch_dtype, options.speculative_tokens)
        return cls(cfg, weights, options, text.load_tokenizer(path), generation)

    @property
    def decodes_ahead(self) -> bool:
        """Whether a greedy decode step launches the next step of its slots before it returns
        (StepGraphs.launch_ahead): options.decode_ahead, with graphs, where ahead_allowed."""
        return self.ahead_allowed and self.graphs is not None

    def warmup(self, progress: bool = True) -> WarmupReport:
        """Capture every graph and compile every kernel variant the options allow, on an idle engine, so that no
        later call stalls on a compile or a capture (pocketlab.warmup says what runs)."""
        return warm_up(self, progress)

    def compile_events(self) -> dict[str, int]:
        """Graph captures of this engine, torch.compile graphs and Triton compiles of the process, so far."""
        return compile_events.counts(self.graphs)

    # -- single-slot API -----------------------------------------------------------------------
    def prefill(self, tokens: list[int], slot_id: int = 0, sampling: SamplingParams = GREEDY) -> ForwardResult:
        """Make `tokens` the slot's sequence (reusing the prefix it already holds) and predict the next token."""
        items = [(slot_id, list(tokens), sampling)]
        self._check_prefill(items, ["prompt"])
        with self._transaction([slot_id]):
            return self._run_prefill(items)[0]

    def decode_step(self, token: int, slot_id: int = 0, sampling: SamplingParams = GREEDY) -> ForwardResult:
        """Append one token to the slot's sequence and predict the next (with speculative_tokens > 0, maybe
        several: `tokens` holds them all, `next_token` the last)."""
        tokens, logits, positions = self._decode([(slot_id, token, sampling)])
        return ForwardResult(tokens[0][-1], logits[0], positions[0], tokens=tokens[0])

    # -- batch API -----------------------------------------------------------------------------
    def batch_prefill(self, requests: list[BatchedRequest]) -> BatchPrefillResult:
        """Prefill every request in ONE ragged forward (per prefill chunk); allocates missing slots."""
        taken = {r.slot_id for r in requests if r.slot_id is not None}
        free = iter(s for s in self.free_slots() if s not in taken)
        maybe = [r.slot_id if r.slot_id is not None else next(free, None) for r in requests]
        if None in maybe:
            raise ValueError(
                f"{maybe.count(None)} request(s) need a slot but only "
                f"{len(self.free_slots())} of {self.num_slots} are free"
            )
        chosen = cast(list[int], maybe)  # none is None now
        items = [(s, r.prompt_tokens, r.sampling) for s, r in zip(chosen, requests, strict=True)]
        self._check_prefill(items, [f"request {r.request_id} prompt" for r in requests])
        fresh = [(r, s) for r, s in zip(requests, chosen, strict=True) if r.slot_id is None]
        with self._transaction(chosen, allocated=[r for r, _ in fresh]):
            for r, s in fresh:  # the slot its prompt is prefilled into (not the first free: that may be a given one)
                self.cache.slots[s].owner, r.slot_id = r.request_id, s
            results = self._run_prefill(items)
        for r, res in zip(requests, results, strict=True):
            r.generated_tokens = [res.next_token]
        return BatchPrefillResult(results)

    def batch_decode_step(self, requests: list[BatchedRequest], go_on: bool = True) -> BatchDecodeResult:
        """Feed each request's last token to its slot, all slots in ONE forward. go_on=False: the caller will not
        feed these same requests their tokens next, so no step is launched ahead for them (decodes_ahead)."""
        for r in requests:
            if r.last_token is None:
                raise ValueError(f"request {r.request_id} has no token to decode; run batch_prefill first")
        items = [(r.slot_id, r.last_token, r.sampling) for r in requests]
        tokens, logits, positions = self._decode(cast(list[tuple[int, int, SamplingParams]], items), go_on)
        for r, t in zip(requests, tokens, strict=True):
            r.generated_tokens.extend(t)
        return BatchDecodeResult([t[-1] for t in tokens], logits, positions, tokens)

    def generate(
        self,
        prompts: list,
        sampling: SamplingParams | list | None = None,
        progress: bool = False,
        enable_thinking: bool | None = None,
        arrivals: list[float] | None = None,
    ) -> list:
        """Continuous batching over the free slots; see pocketlab.generate. Token-id prompts give token lists
        (sampling=None: greedy; arrivals: when each is submitted, for replaying a trace); if any prompt is a string
        or a chat (list of {"role", "content"}), every prompt gives a text.Completion (sampling=None: the
        checkpoint's defaults, see default_sampling)."""
        if arrivals is not None and self.shard.world > 1:  # admission by the clock would differ between the ranks
            raise ValueError("arrivals (submission by wall-clock time) is not supported with tensor_parallel > 1")
        if all(text.is_token_ids(p) for p in prompts):
            return continuous_batching(self, prompts, GREEDY if sampling is None else sampling, progress, arrivals)
        if arrivals is not None:
            raise ValueError("arrivals replay traces of token-id prompts; text prompts are submitted at once")
        return text.complete(self, prompts, sampling, enable_thinking, progress)

    def stream(
        self, prompts: list, sampling: SamplingParams | list | None = None, enable_thinking: bool | None = None
    ) -> Iterator[text.TextDelta]:
        """generate() as it happens: a TextDelta (index, new text, new tokens, done) per request per forward."""
        return text.stream(self, prompts, sampling, enable_thinking)

    def default_sampling(self, **overrides) -> SamplingParams:
        """The checkpoint's generation defaults (eos stop ids, temperature, top_p, top_k), with `overrides`."""
        return dataclasses.replace(SamplingParams(**self.generation), **overrides)

    def require_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError(
                "text prompts need a tokenizer: this engine has none (the checkpoint folder ships no tokenizer.json "
                "/ tokenizer_config.json); pass token ids, or QwenEngine(..., tokenizer=...)"
            )
        return self.tokenizer

    # -- slots ---------------------------------------------------------------------------------
    def allocate_batch_slots(self, n: int) -> None:
        """Use slots 0..n-1 (n <= max_slots); slots beyond are cleared and freed."""
        if not 1 <= n <= self.options.slot_count:
            raise ValueError(f"allocate_batch_slots({n}): need 1 <= n <= max_slots={self.options.max_slots}")
        for s in range(n, self.num_slots):
            self.release_slot(s)
        self.num_slots = n

    def free_slots(self) -> list[int]:
        """Slots no request owns, in order."""
        return [s for s in range(self.num_slots) if self.cache.slots[s].owner is None]

    def allocate_slot(self, request_id: int) -> int:
        free = self.free_slots()
        if not free:
            raise ValueError(f"all {self.num_slots} slots are taken; release one before allocating")
        self.cache.slots[free[0]].owner = request_id
        return free[0]

    def release_slot(self, slot_id: int) -> None:
        self._check_slot(slot_id)
        with self._transaction([slot_id]):
            self.cache.clear(slot_id)
        self.cache.slots[slot_id].owner = None

    def reset(self, slot_id: int | None = None) -> None:
        """Forget the sequence of one slot, or of every slot (allocations are kept)."""
        if slot_id is not None:
            self._check_slot(slot_id)
        slots = list(range(self.num_slots)) if slot_id is None else [slot_id]
        with self._transaction(slots):
            for s in slots:
                self.cache.clear(s)
            if self.prefix is not None:  # a reset engine computes like a fresh one: nothing before it is reused
                self.prefix.forget(slot_id)

    def position(self, slot_id: int = 0) -> int:
        self._check_slot(slot_id)
        return self.cache.slots[slot_id].position

    def snapshot(self, slot_id: int = 0) -> Snapshot:
        """The slot's state; split over ranks, every rank's part gathered into the one-device layout."""
        self._check_slot(slot_id)
        snap = self.cache.snapshot(slot_id)
        return snap if self.shard.world == 1 else gather_snapshot(snap, self.shard, self.cfg)

    def restore(self, snapshot: Snapshot, slot_id: int = 0) -> None:
        """Restore a snapshot taken at any tensor_parallel (it holds the one-device layout; each rank its part)."""
        self._check_slot(slot_id)
        snapshot = dataclasses.replace(snapshot, tensors=self.shard.local_snapshot(snapshot.tensors, self.cfg))
        self.cache.check_snapshot(snapshot)
        self.check_tokens(snapshot.tokens, "snapshot history", allow_empty=True)
        with self._transaction([slot_id]):
            self.cache.restore(snapshot, slot_id)

    # -- interrupted calls: the slots a call touches are committed whole or cleanly reset -----------
    @contextmanager
    def _transaction(self, slots: list[int], allocated: Sequence[BatchedRequest] = ()):
        """Run a call that changes `slots`. If anything inside raises (an error, a KeyboardInterrupt), those slots
        are cleanly reset (empty history, zeroed state, owner as before the call: slots it allocated to
        `allocated` requests are free again), every other slot is as it was, and the prefix cache, which may
        have been mid-update, starts over empty: it is a cache, so only reuse is lost. Then it re-raises. A `Refusal`
        (bad input found before anything changed) passes through and leaves the slots alone."""
        try:
            yield
        except Refusal:  # found before anything changed
            raise
        except BaseException:
            self._abort(slots, allocated)
            raise

    def _abort(self, slots: list[int], allocated: Sequence[BatchedRequest]) -> None:
        self.cache.listen(None)  # the slots' live state may be half-written: nothing may checkpoint it
        for s in slots:
            self.cache.clear(s)
        for r in allocated:
            if r.slot_id is not None:
                self.cache.slots[r.slot_id].owner = None
                r.slot_id = None
        if self.prefix is not None:
            self.prefix = PrefixCache(self.cache, self.options)  # registers itself as the listener

    # -- validation: every check runs before any state changes --------------------------------
    def _check_slot(self, slot_id) -> None:
        if not isinstance(slot_id, int) or not 0 <= slot_id < self.num_slots:
            raise IndexError(f"slot {slot_id!r} does not exist: allocated slots are 0..{self.num_slots - 1}")

    def check_tokens(self, tokens, what: str, allow_empty: bool = False) -> None:
        """ValueError naming `what` unless every token is an int in the vocabulary (and, unless allow_empty, one is
        there)."""
        if not tokens and not allow_empty:
            raise ValueError(f"{what} is empty: at least one token is needed")
        bad = [t for t in tokens if not isinstance(t, int) or not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"{what} has token(s) outside the vocabulary [0, {self.cfg.vocab_size}): {bad[:5]}")

    def _check_plan(self, slots: list[int], seqs: list[tuple[int, list[int]]], prefill: bool) -> None:
        for s in slots:
            self._check_slot(s)
        if len(set(slots)) < len(slots):
            dup = sorted(s for s, n in Counter(slots).items() if n > 1)
            raise ValueError(f"slot(s) {dup} appear more than once in one batch; each slot runs one sequence")
        limit = self.options.max_seq_len
        for s, toks in seqs:
            position = 0 if prefill else self.cache.slots[s].position
            if position + len(toks) > limit:
                raise ValueError(f"slot {s}: {position + len(toks)} tokens would exceed max_seq_len={limit}")
            if not prefill and position == 0:
                raise ValueError(f"slot {s} holds no sequence: prefill it before decode_step")

    # -- forward -------------------------------------------------------------------------------
    def _check_prefill(self, items: list[tuple[int, list[int], SamplingParams]], names: list[str]) -> None:
        for (_, toks, _), name in zip(items, names, strict=True):
            self.check_tokens(toks, name)
        self._check_plan([s for s, _, _ in items], [(s, t) for s, t, _ in items], prefill=True)

    def _run_prefill(self, items: list[tuple[int, list[int], SamplingParams]]) -> list[ForwardResult]:
        starts = [self._reuse_prefix(s, toks) for s, toks, _ in items]
        stride = self.prefix.stride_for_pieces() if self.prefix is not None else 0
        pieces = [
            plan_pieces(p, len(t), self.options.prefill_chunk, stride)
            for (_, t, _), p in zip(items, starts, strict=True)
        ]
        last_hidden: list[torch.Tensor | None] = [None] * len(items)
        for c in range(max(map(len, pieces))):
            rows = [b for b in range(len(items)) if c < len(pieces[b])]
            runs = [Run(items[b][0], pieces[b][c][0], items[b][1][slice(*pieces[b][c])]) for b in rows]
            # hybrid models: the layers hand back their state at stride multiples inside each piece
            marks = [self.prefix.marks(lo, lo + len(piece)) if self.prefix is not None else [] for _, lo, piece in runs]
            last, ctx = self._prompt_forward(runs, [(i, t) for i, ts in enumerate(marks) for t in ts])
            for i, (b, (s, lo, piece)) in enumerate(zip(rows, runs, strict=True)):
                last_hidden[b] = last[i]
                self.cache.slots[s].extend(piece)
                if self.prefix is not None:
                    for t in marks[i]:
                        self.prefix.reached(s, lo + t, final=False, state=ctx.checkpoint_states[(i, t)])
                    self.prefix.reached(s, lo + len(piece), final=c == len(pieces[b]) - 1)
        logits = self.model.logits(torch.stack(cast(list[torch.Tensor], last_hidden)))
        positions = [len(t) for _, t, _ in items]
        params = [sp for _, _, sp in items]
        tokens = sample(penalize(logits, params, lambda b: items[b][1]), params, positions).tolist()
        return [
            ForwardResult(t, logits[i], positions[i], starts[i], positions[i] - starts[i]) for i, t in enumerate(tokens)
        ]

    def _reuse_prefix(self, slot: int, tokens: list[int]) -> int:
        """Bring the slot to the longest prefix of `tokens` the prefix cache can supply (from this slot, another
        slot or a retained entry); the last token is always computed. Returns where computing starts."""
        if self.prefix is None:
            self.cache.clear(slot)
            return 0
        return self.prefix.prepare(slot, tokens)

    def _decode(self, items: list[tuple[int, int, SamplingParams]], go_on: bool = True):
        """One decode step of (slot, token, sampling) items; with `go_on`, a greedy step launches the next ahead
        where the engine does that (decodes_ahead)."""
        vocab = self.cfg.vocab_size
        for s, tok, _ in items:
            if not (isinstance(tok, int) and 0 <= tok < vocab):  # check_tokens inline: this runs every step
                self.check_tokens([tok], f"decode token for slot {s}")
        self._check_plan([s for s, _, _ in items], [(s, [t]) for s, t, _ in items], prefill=False)
        with self._transaction([s for s, _, _ in items]):
            if self.speculator is not None:  # tokens per item: accepted drafts + one, from one verify forward
                out = self.speculator.step(items)
                self.forward_count += 1
                return out
            runs = [Run(s, self.cache.slots[s].position, [tok]) for s, tok, _ in items]
            params = [sp for _, _, sp in items]
            ahead = go_on and self.decodes_ahead and all(p.greedy and p.repetition_penalty == 1.0 for p in params)
            logits, greedy = self._decode_logits(runs, ahead)
            positions = [run.start + 1 for run in runs]
            seen = penalize(logits, params, lambda b: [*self.cache.slots[items[b][0]].tokens, items[b][1]])
            plain = seen is logits and all(p.greedy for p in params)  # no penalty, no draw: the argmax as it is
            tokens = greedy if plain and greedy is not None else sample(seen, params, positions).tolist()
            for s, tok, _ in items:
                self.cache.slots[s].extend([tok])
        return [[t] for t in tokens], logits, positions

    @torch.inference_mode()
    def _decode_logits(self, runs: list[Run], ahead: bool = False) -> tuple[torch.Tensor, list[int] | None]:
        """One decode step's [B, vocab] float32 logits, and their argmax per row (the greedy tokens) where a graph
        computed it (None: `sample` takes it); `ahead`: the graph launches the next step too (StepGraphs.logits)."""
        if self.graphs is None:
            hidden, _ = self._forward(runs)
            return self.model.logits(hidden[:, 0]), None
        self.forward_count += 1
        return self.graphs.logits(runs, ahead)

    @torch.inference_mode()
    def _prompt_forward(self, runs: list[Run], checkpoints: Sequence[tuple[int, int]]):
        """(final-normed hidden states at each run's last token [B, hidden], the forward's context or None): a
        graph's replay where the options allow one (prefill_graph_tokens; no checkpoints to hand back), else the
        eager forward. A drafter sees every row either way."""
        hidden = self.graphs.prefill(runs) if self.graphs is not None and not checkpoints else None
        ctx = None
        if hidden is not None:
            self.forward_count += 1
        else:
            hidden, ctx = self._forward(runs, checkpoints)
        if self.speculator is not None:  # the MTP head writes its rows for these positions
            self.speculator.observe(runs, hidden)
        return torch.stack([hidden[i, len(run.tokens) - 1] for i, run in enumerate(runs)]), ctx

    @torch.inference_mode()
    def _forward(
        self, runs: list[Run], checkpoints: Sequence[tuple[int, int]] = ()
    ) -> tuple[torch.Tensor, ForwardContext]:
        """(final-normed hidden states [B, T, hidden], the forward's context: checkpoint_states holds the linear
        layers' states at the (row, offset) `checkpoints`)."""
        self.forward_count += 1
        ctx = ForwardContext.build(runs, self.cache.scratch, self.options.device, checkpoints=checkpoints)
        with compiled_kernels(self.options.compile and not self.options.batch_invariant, min_elements=LARGE):
            hidden = self.model.forward(ctx, self.cache)
        return hidden, ctx
