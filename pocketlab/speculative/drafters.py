"""Where drafts come from: the drafter interface, the draw of a draft from the head's distribution (`choose`)
and the MTP head drafter."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..config import MAX_SPECULATIVE_TOKENS
from ..forward import ForwardContext, Run
from ..sampling import SamplingParams, filtered_probs, inverse_cdf
from .acceptance import DRAW_DRAFT

if TYPE_CHECKING:
    from .speculator import Speculator


@dataclass
class Row:
    """One slot's part of a speculative step."""

    slot: int
    position: int  # n: tokens cached in the slot before the step
    token: int  # x_n: the token this step feeds
    sampling: SamplingParams
    k: int  # most drafts this row may verify


@dataclass
class Drafts:
    """A drafter's proposals for a step, one entry per row."""

    tokens: list[list[int]]  # per row, at most row.k
    probs: list[torch.Tensor | None]  # per row: q [len, vocab] the drafts were drawn from; None: fixed drafts


class Drafter:
    """Where drafts come from. `observe` sees every main forward outside verification (prefill chunks);
    `commit` sees each verification's outcome (kept[b] tokens of the fed run are now in slot b)."""

    name = "drafter"

    def bind(self, spec: Speculator) -> None:
        pass

    def draft(self, spec: Speculator, rows: list[Row]) -> Drafts:
        raise NotImplementedError

    def observe(self, spec: Speculator, runs: list[Run], hidden: torch.Tensor) -> None:
        pass

    def graph_steps(self, spec: Speculator) -> list[tuple]:
        """The graphs this drafter's steps replay, as Speculator.graph_steps lists them (none: drafts eagerly)."""
        return []

    def commit(self, spec: Speculator, rows: list[Row], kept: list[int], hidden: torch.Tensor) -> None:
        pass


def choose(logits: torch.Tensor, rows: list[Row], index: list[int]) -> tuple[list[int], list[torch.Tensor | None]]:
    """A draft per row from draft logits [B, V]: argmax for greedy rows; for sampling rows a draw (uniform
    draw 1 at sequence index `index[b]`) from q = the same filtered distribution the target uses."""
    tokens = logits.argmax(-1)
    probs: list[torch.Tensor | None] = [None] * len(rows)
    samp = [b for b, r in enumerate(rows) if not r.sampling.greedy]
    if samp:
        q = filtered_probs(logits[samp], [rows[b].sampling for b in samp])
        u = torch.tensor([rows[b].sampling.uniform(index[b], DRAW_DRAFT) for b in samp], device=logits.device)
        tokens[samp] = inverse_cdf(q, u)
        for j, b in enumerate(samp):
            probs[b] = q[j]
    return tokens.tolist(), probs


class MTPDrafter(Drafter):
    """Drafts with the checkpoint's MTP head (pocketlab.models.mtp), applied recursively for k > 1.

    Per slot it keeps a queue of the main model's final-normed hidden states h_t whose MTP rows are not
    written yet (positions end-count .. end-1; at most k+1 of them), as SlotCache extras so snapshots carry
    it. A step's first MTP forward writes all queued rows (pairs (h_t, x_{t+1}), the last with x_n) from the
    real hidden states and its last output gives d_1; d_2 .. d_k come from one-row recursive forwards whose
    MTP KV rows are provisional and get overwritten. After verification the queue holds h_n .. h_{n+a}.
    Prefill (observe) writes the prompt's rows the same way and leaves h_{len-1} queued.
    """

    name = "mtp"
    head: Any  # the model's MTPHead: bind sets it or raises, so never None once bound

    def __init__(self):
        self.trace: list | None = None  # set to [] to keep each draft's logits and tokens (tests, notebooks)

    def bind(self, spec):
        eng = spec.engine
        self.head = getattr(eng.model, "mtp", None)
        if self.head is None:
            raise ValueError(
                "MTPDrafter needs the model's MTP head (a Qwen3.5 checkpoint with mtp.* tensors, "
                "loaded with EngineOptions(speculative_tokens > 0))"
            )
        cache = eng.cache
        self.head.register(cache)
        if "mtp_hidden" not in cache.extra:
            cache.add_extra(
                "mtp_hidden",
                (MAX_SPECULATIVE_TOKENS + 1, eng.cfg.hidden_size),
                eng.options.torch_dtype,
                eng.options.device,
            )
            cache.add_extra("mtp_queue", (2,), torch.long, eng.options.device)  # (count, end position)
        self.hidden, self.queue = cache.extra["mtp_hidden"], cache.extra["mtp_queue"]

    def _queues(self, spec, slots: list[int], ends: list[int]) -> list[int]:
        """Usable queue length per slot: 0 unless the queue ends where the slot's sequence does."""
        state = self.queue[torch.tensor(slots, device=self.queue.device)].tolist()
        return [c if e == end and c > 0 else 0 for (c, e), end in zip(state, ends, strict=True)]

    def _write_rows(self, spec, runs: list[Run], hidden: torch.Tensor) -> torch.Tensor:
        ctx = ForwardContext.build(runs, spec.engine.cache.scratch, spec.engine.options.device)
        return self.head.forward(ctx, hidden, spec.engine.cache)

    def _set_queue(self, slots: list[int], src: torch.Tensor, counts: list[int], ends: list[int]) -> None:
        """queue[slot] = src[b, :counts[b]] (src [B, T, d])."""
        dev = self.hidden.device
        b_idx = [b for b, c in enumerate(counts) for _ in range(c)]
        cols = [j for c in counts for j in range(c)]
        slot_idx = [slots[b] for b in b_idx]
        if b_idx:
            self.hidden[torch.tensor(slot_idx, device=dev), torch.tensor(cols, device=dev)] = src[
                torch.tensor(b_idx, device=src.device), torch.tensor(cols, device=src.device)
            ].to(self.hidden.dtype)
        self.queue[torch.tensor(slots, device=dev)] = torch.tensor(
            [[c, e] for c, e in zip(counts, ends, strict=True)], device=dev
        )

    def _pending(self, spec, slot: int, start: int, count: int, next_token: int):
        """(first row position, tokens x_{t+1}) of the queued rows of `slot`, whose sequence holds `start` tokens."""
        hist = spec.engine.cache.slots[slot].tokens
        return start - count, hist[start - count + 1 : start] + [next_token]

    def observe(self, spec, runs, hidden):
        slots = [run.slot for run in runs]
        counts = self._queues(spec, slots, [run.start for run in runs])
        rows, parts = [], []
        for b, ((s, start, toks), m) in enumerate(zip(runs, counts, strict=True)):
            if len(spec.engine.cache.slots[s].tokens) != start:
                m = 0
            first, toks_q = self._pending(spec, s, start, m, toks[0]) if m else (start, [])
            rows.append(Run(s, first, toks_q + list(toks[1:])))
            parts.append((b, m, len(toks) - 1))
        live = [i for i, row in enumerate(rows) if row.tokens]
        if live:
            T = max(len(rows[i].tokens) for i in live)
            hid = hidden.new_zeros(len(live), T, hidden.shape[-1])
            for j, i in enumerate(live):
                b, m, new = parts[i]
                if m:
                    hid[j, :m] = self.hidden[rows[i].slot, :m].to(hid.dtype)
                hid[j, m : m + new] = hidden[b, :new]
            self._write_rows(spec, [rows[i] for i in live], hid)
        lengths = [len(run.tokens) for run in runs]
        last = torch.stack([hidden[b, n - 1] for b, n in enumerate(lengths)])[:, None]
        self._set_queue(slots, last, [1] * len(runs), [run.start + n for run, n in zip(runs, lengths, strict=True)])

    def draft(self, spec, rows):
        slots = [r.slot for r in rows]
        counts = self._queues(spec, slots, [r.position for r in rows])
        if self._graphed(spec, rows, counts):
            drafts = self._draft_graphed(spec, rows, counts)
            if drafts is not None:
                return drafts
        tokens: list[list[int]] = [[] for _ in rows]
        probs: list[list] = [[] for _ in rows]
        step = [b for b, m in enumerate(counts) if m]  # a slot without a usable queue verifies no drafts
        if step:
            runs = [
                Run(rows[b].slot, *self._pending(spec, rows[b].slot, rows[b].position, counts[b], rows[b].token))
                for b in step
            ]
            T = max(counts[b] for b in step)
            hid = self.hidden[torch.tensor([slots[b] for b in step], device=self.hidden.device), :T]
            out = self._write_rows(spec, runs, hid)
            at = torch.tensor([counts[b] - 1 for b in step], device=out.device)
            last = out[torch.arange(len(step), device=out.device), at]  # o_{n-1} per row
        for i in range(1, spec.k + 1):  # d_i comes from MTP row t = n + i - 2
            want = [j for j, b in enumerate(step) if rows[b].k >= i]
            if not want:
                break
            step, last = [step[j] for j in want], last[want]
            if i > 1:  # recursive row: the head's own output o_{t-1} stands in for h_t (not known yet)
                runs = [Run(rows[b].slot, rows[b].position + i - 2, [tokens[b][-1]]) for b in step]
                last = self._write_rows(spec, runs, last[:, None])[:, 0]
            sub = [rows[b] for b in step]
            logits = self.head.logits(last)
            if self.trace is not None:
                self.trace.append(
                    dict(
                        draft=i,
                        slots=[r.slot for r in sub],
                        positions=[r.position for r in sub],
                        logits=logits.detach().float().cpu(),
                    )
                )
            picked, q = self.pick(logits, sub, i)
            if self.trace is not None:
                self.trace[-1]["tokens"] = list(picked)
            for j, b in enumerate(step):
                tokens[b].append(picked[j])
                probs[b].append(q[j])
        return Drafts(tokens, [torch.stack(p) if p and p[0] is not None else None for p in probs])

    def _graphed(self, spec, rows, counts) -> bool:
        """Greedy rows that each draft spec.k tokens from a usable queue, on an engine that captures graphs, with
        `pick` as here: the whole draft (queued rows, k-1 recursive rows, k logits and argmaxes) is one graph."""
        return (
            spec.engine.graphs is not None
            and type(self).pick is MTPDrafter.pick
            and all(counts)
            and all(r.sampling.greedy and r.k == spec.k for r in rows)
        )

    def graph_steps(self, spec):
        if spec.engine.graphs is None:
            return []
        k = spec.k  # a slot's queue holds 1 .. k+1 rows: one graph per queue length
        step = lambda ctx: self._draft_step(spec, k, ctx)  # noqa: E731
        return [(f"draft{k}", queued, k - 1, step, None) for queued in range(1, k + 2)]

    def _draft_graphed(self, spec, rows, counts) -> Drafts | None:
        """The draft replayed from a CUDA graph (None: it could not be captured, draft eagerly)."""
        k = spec.k
        runs = [
            Run(r.slot, *self._pending(spec, r.slot, r.position, c, r.token)) for r, c in zip(rows, counts, strict=True)
        ]
        out = spec.engine.graphs.replay(
            f"draft{k}", lambda ctx: self._draft_step(spec, k, ctx), runs, real_lengths=True, beyond=k - 1
        )
        if out is None:
            return None
        tokens = out[0][: len(rows)].tolist()
        if self.trace is not None:
            for i in range(k):
                self.trace.append(
                    dict(
                        draft=i + 1,
                        slots=[r.slot for r in rows],
                        positions=[r.position for r in rows],
                        logits=out[1][: len(rows), i].to("cpu", torch.float32, copy=True),
                        tokens=[t[i] for t in tokens],
                    )
                )  # copied: the next replay overwrites out
        return Drafts(tokens, [None] * len(rows))

    def _draft_step(self, spec, k: int, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy drafts [B, k] and their logits [B, k, vocab] from the queued rows in `ctx` (lengths: each
        slot's queue), all on the device: the eager loop of `draft`, without its host round trips."""
        cache = spec.engine.cache
        B, T = ctx.tokens.shape
        last = self.head.forward(ctx, self.hidden[ctx.slot_ids, :T], cache)
        last = last[torch.arange(B, device=last.device), ctx.lengths - 1]  # o_{n-1} per row
        position = ctx.start + ctx.lengths  # n per row
        tokens: list[torch.Tensor] = []
        logits: list[torch.Tensor] = []
        for i in range(1, k + 1):
            if i > 1:  # recursive row t = n + i - 2, as in `draft`
                row = ForwardContext(
                    tokens=tokens[-1][:, None],
                    slot_ids=ctx.slot_ids,
                    start=position + (i - 2),
                    lengths=torch.ones_like(position),
                    kv_len=ctx.kv_len,
                    scratch_slot=ctx.scratch_slot,
                )
                last = self.head.forward(row, last[:, None], cache)[:, 0]
            logits.append(self.head.logits(last))
            tokens.append(logits[-1].argmax(-1))
        return torch.stack(tokens, 1), torch.stack(logits, 1)

    def pick(self, logits: torch.Tensor, rows: list[Row], i: int):
        """Draft d_i per row from the head's logits [B, V] -> (tokens, q per row or None)."""
        return choose(logits, rows, [r.position + i for r in rows])

    def commit(self, spec, rows, kept, hidden):
        self._set_queue([r.slot for r in rows], hidden, kept, [r.position + c for r, c in zip(rows, kept, strict=True)])
