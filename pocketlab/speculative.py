"""Speculative decoding over the slot API: every slot drafts, ONE forward verifies them all, each slot keeps
what agrees, and everything else is rolled back exactly.

A step, for each slot b holding n tokens and feeding its last emitted token x_n:
  1. draft   a drafter proposes d_1 .. d_k (k <= EngineOptions.speculative_tokens, fewer near max_seq_len);
  2. verify  one main-model forward over [x_n, d_1 .. d_k] at positions n .. n+k for all slots together
             (ragged runs: every slot may have its own k) gives target logits y_0 .. y_k;
  3. accept  greedy: the longest prefix with d_{i+1} == argmax y_i, plus the target's own next token;
             sampling: speculative rejection sampling (accept d with prob min(1, p(d)/q(d)), else draw from
             norm(max(0, p - q)); a bonus draw from p_k when every draft is accepted), which leaves the
             distribution of every token exactly that of plain sampling;
  4. roll back  a slot that kept a+1 of its k+1 fed tokens: token history (and so the attention KV, which is
             masked by position) is cut to n+a+1; each Gated DeltaNet layer's conv window and recurrent state
             are set to those after token n+a (see below); the MTP head's rows are rebuilt from the main
             model's real hidden states in the next draft (see MTPDrafter).

Rollback of the recurrent state (EngineOptions.speculative_rollback). The verify forward keeps, per GDN
layer, the states it started from (the gather into the batch already copies them) and its inputs; the conv
window needs nothing more: it is the last K-1 inputs of [start window | kept inputs]. Two ways to land on
the state after token n+a:
  "states" (default): the verify forward runs the delta rule token by token (the same T=1 kernel plain
           decoding runs) and keeps every intermediate state ([B, k+1, H, dk, dv] fp32 per layer); rollback
           is an index. Measured on CPU (tiny model, `verify.mtp.verify_cost`): a verify step costs 2.5 ms
           against 3.2 ms for the chunked form, and a rejecting step 2.8 ms against 4.8 ms for replay, at
           every k = 1..3; and the GDN arithmetic is plain decoding's own, so low-precision runs stay closer
           to it. Cost: (k+1) states written per slot and layer (9B shape: ~48 MiB per slot per position).
  "replay": the verify forward runs the usual chunked rule; slots that rejected something re-run it from
           the saved start state over their a+1 kept tokens. Fewer state bytes (2 per rejecting slot instead
           of k+1 per slot), more launches: the better choice where state traffic dominates (large batches
           on a GPU with fla). verify_cost reports both (`*_replay_*` columns) to settle it per device.

CUDA graphs. With rollback "states" on an engine that captures graphs, the verify forward replays a graph
per (batch bucket, k+1, key bucket): every row runs the longest run's k+1 tokens (shorter runs padded; the
padding's K/V rows lie past the slot's tokens and its states are never kept), and the rollback is a second
graph that restores every row that kept fewer than k+1. H200, Qwen3.5-9B shape, batch 1: the graphed verify
step costs 8.0-8.5 ms for k = 1..3 against 5.15 ms for a plain step; the eager one, launch-bound, 120 ms.
There the eager MTP drafter cost ~1.8 ms per draft, so greedy drafting now replays a graph too (the queued
rows, the k-1 recursive rows and the argmaxes on the device, one host round trip; not yet run on a GPU);
sampling rows, rows without a usable queue and rows drafting fewer than k tokens draft eagerly.

Uniform numbers come from SamplingParams.uniform(index, draw), index being the sequence index of the token
being decided: draw 0 for a token drawn straight from the target (the bonus token; also what plain
decoding uses), 1 for drawing a draft from q, 2 for the acceptance test, 3 for the residual draw.
So results do not depend on the batch a slot runs in.

`engine.forward_count` counts main-model forwards: one per speculative step. Draft forwards (MTP) are not
counted; `Speculator.stats` has acceptance figures.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .config import MAX_SPECULATIVE_TOKENS
from .forward import ForwardContext, Run
from .layers.gated_delta import L2_EPS, backend_name, conv_inputs, gated_delta_rule, window_at
from .layers.linear_decode import recurrent_step
from .sampling import SamplingParams, filtered_probs, inverse_cdf

DRAW_TARGET, DRAW_DRAFT, DRAW_ACCEPT, DRAW_RESIDUAL = 0, 1, 2, 3


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
    tokens: list[list[int]]  # per row, at most row.k
    probs: list[torch.Tensor | None]  # per row: q [len, vocab] the drafts were drawn from; None: fixed drafts


@dataclass
class SpecStats:
    steps: int = 0  # speculative decode calls
    rows: int = 0  # slot-steps
    drafted: int = 0  # drafts verified
    accepted: int = 0  # drafts accepted
    emitted: int = 0  # tokens produced (accepted drafts + one target token per slot-step)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def tokens_per_step(self) -> float:
        """Tokens per slot per step (1.0 = no gain)."""
        return self.emitted / self.rows if self.rows else float("nan")


# -- drafters ------------------------------------------------------------------------------------
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

    def __init__(self):
        self.trace: list | None = None  # set to [] to record each step's draft logits (tests, notebooks)

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
        return [c if e == end and c > 0 else 0 for (c, e), end in zip(state, ends)]

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
        self.queue[torch.tensor(slots, device=dev)] = torch.tensor([[c, e] for c, e in zip(counts, ends)], device=dev)

    def _pending(self, spec, slot: int, start: int, count: int, next_token: int):
        """(first row position, tokens x_{t+1}) of the queued rows of `slot`, whose sequence holds `start` tokens."""
        hist = spec.engine.cache.slots[slot].tokens
        return start - count, hist[start - count + 1 : start] + [next_token]

    def observe(self, spec, runs, hidden):
        slots = [run.slot for run in runs]
        counts = self._queues(spec, slots, [run.start for run in runs])
        rows, parts = [], []
        for b, ((s, start, toks), m) in enumerate(zip(runs, counts)):
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
        self._set_queue(slots, last, [1] * len(runs), [run.start + n for run, n in zip(runs, lengths)])

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

    def _draft_graphed(self, spec, rows, counts) -> Drafts | None:
        """The draft replayed from a CUDA graph (None: it could not be captured, draft eagerly)."""
        k = spec.k
        runs = [Run(r.slot, *self._pending(spec, r.slot, r.position, c, r.token)) for r, c in zip(rows, counts)]
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
        tokens, logits = [], []
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
        self._set_queue([r.slot for r in rows], hidden, kept, [r.position + c for r, c in zip(rows, kept)])


def _continuation(references, slot: int):
    if references is None:
        return None
    return (
        references.get(slot) if isinstance(references, dict) else (references[slot] if slot < len(references) else None)
    )


class OracleDrafter(Drafter):
    """Drafts read from known full sequences (prompt + greedy continuation), per slot: with the right
    reference every greedy draft is accepted, so steps measure the verify cost at full acceptance.
    references: {slot: tokens} or a list indexed by slot. accuracy < 1 makes each draft wrong (reference
    token + 1) unless a uniform drawn from (seed, sequence index) falls below it: a drafter with a chosen
    per-token acceptance rate, for sweeps and for exercising partial acceptance."""

    name = "oracle"

    def __init__(self, references, accuracy: float = 1.0, seed: int = 0):
        self.references, self.accuracy, self.seed = references, accuracy, seed

    def _right(self, index: int) -> bool:
        return self.accuracy >= 1 or (
            self.accuracy > 0 and SamplingParams(seed=self.seed).uniform(index, 7) < self.accuracy
        )

    def draft(self, spec, rows):
        V = spec.engine.cfg.vocab_size
        out = []
        for r in rows:
            seq = _continuation(self.references, r.slot) or []
            ref = seq[r.position + 1 : r.position + 1 + r.k]
            out.append([t if self._right(r.position + 1 + i) else (t + 1) % V for i, t in enumerate(ref)])
        return Drafts(out, [None] * len(rows))


class AdversarialDrafter(Drafter):
    """Drafts that are always wrong for greedy decoding: each reference token + 1 (mod vocab), or, with
    no reference, x_n + 1 + i. Every step then rejects at the first draft and rolls everything back."""

    name = "adversarial"

    def __init__(self, references=None):
        self.references = references

    def draft(self, spec, rows):
        V = spec.engine.cfg.vocab_size
        out = []
        for r in rows:
            seq = _continuation(self.references, r.slot)
            if seq is not None and len(seq) >= r.position + 1 + r.k:
                out.append([(t + 1) % V for t in seq[r.position + 1 : r.position + 1 + r.k]])
            else:
                out.append([(r.token + 1 + i) % V for i in range(r.k)])
        return Drafts(out, [None] * len(rows))


# -- verification ------------------------------------------------------------------------------
class _StatesRule:
    """A delta rule that runs token by token and keeps every intermediate state (rollback "states").
    `shortest`: the fewest tokens any row feeds; positions below it are real in every row, so they skip the
    padding masks (a dozen small kernels per token and layer). `in_place`: those positions run the one-launch
    Triton step of layers.linear_decode on a working copy of the state (CUDA; the fla call it replaces costs
    far more host time per token)."""

    def __init__(self, shortest: int = 0, in_place: bool = False):
        self.shortest, self.in_place = shortest, in_place
        self.states: list[torch.Tensor] = []  # per GDN layer, in layer order: [B, T, H, dk, dv]

    def __call__(self, q, k, v, g, beta, S, lengths):
        outs, per = [], []
        rows = torch.arange(q.shape[0], device=q.device)
        S = S.to(torch.float32).clone()  # a working copy: the in-place step writes it, the cache stays as it was
        for t in range(q.shape[1]):
            if t < self.shortest and self.in_place:
                o = recurrent_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], S, rows, L2_EPS)[:, None]
            else:
                live = None if lengths is None or t < self.shortest else (lengths > t).to(lengths.dtype)
                o, S = gated_delta_rule(
                    q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], g[:, t : t + 1], beta[:, t : t + 1], S, live
                )
            outs.append(o)
            per.append(S.clone())  # S may be advanced in place at the next position
        self.states.append(torch.stack(per, 1))
        return torch.cat(outs, 1), S


def accept(logits: torch.Tensor, rows: list[Row], drafts: Drafts) -> tuple[list[list[int]], list[int]]:
    """Target logits [B, T, V] of the fed runs [x_n, d_1 .. d_k] -> (emitted tokens, kept count) per row."""
    greedy = logits.argmax(-1).tolist()
    emitted, kept = [], []
    samp = [b for b, r in enumerate(rows) if not r.sampling.greedy]
    p_all = None
    if samp:
        T, V = logits.shape[1], logits.shape[2]
        params = [rows[b].sampling for b in samp for _ in range(T)]
        p_all = filtered_probs(logits[samp].reshape(-1, V), params).view(len(samp), T, V)
    for b, (r, d) in enumerate(zip(rows, drafts.tokens)):
        if r.sampling.greedy:
            a = 0
            while a < len(d) and d[a] == greedy[b][a]:
                a += 1
            emitted.append(greedy[b][: a + 1])
        else:
            a, tok = _reject_sample(p_all[samp.index(b)], d, drafts.probs[b], r)
            emitted.append(d[:a] + [tok])
        kept.append(a + 1)
    return emitted, kept


def _reject_sample(p: torch.Tensor, d: list[int], q: torch.Tensor | None, r: Row) -> tuple[int, int]:
    """Speculative rejection sampling for one row: p [T, V] target, q [k, V] draft (None: fixed drafts,
    i.e. q one-hot). Returns (accepted drafts, the token drawn after them)."""
    sp, k = r.sampling, len(d)
    if k:
        ar = torch.arange(k, device=p.device)
        dt = torch.tensor(d, device=p.device)
        pd = p[ar, dt].tolist()
        qd = q[ar, dt].tolist() if q is not None else [1.0] * k
        for i in range(k):
            index = r.position + 1 + i
            if qd[i] > 0 and sp.uniform(index, DRAW_ACCEPT) < pd[i] / qd[i]:
                continue
            if q is not None:
                resid = (p[i] - q[i]).clamp_min(0)
            else:
                resid = p[i].clone()
                resid[d[i]] = 0
            if float(resid.sum()) <= 0:  # p == q up to rounding: any draw from p is right
                resid = p[i]
            u = torch.tensor([sp.uniform(index, DRAW_RESIDUAL)], device=p.device)
            return i, int(inverse_cdf(resid[None], u)[0])
    u = torch.tensor([sp.uniform(r.position + 1 + k, DRAW_TARGET)], device=p.device)
    return k, int(inverse_cdf(p[k][None], u)[0])


class Speculator:
    """The engine's speculative decode step (EngineOptions.speculative_tokens > 0). Swap the draft source
    with `use(drafter)`; the default is the checkpoint's MTP head."""

    def __init__(self, engine):
        self.engine, self.k = engine, engine.options.speculative_tokens
        self.rollback = engine.options.speculative_rollback
        self.stats = SpecStats()
        if getattr(engine.model, "mtp", None) is None:
            cfg = engine.cfg
            raise ValueError(
                f"speculative_tokens={self.k} needs an MTP head, and this {cfg.model_type} model has none: "
                "only Qwen3.5 checkpoints that declare mtp_num_hidden_layers (text_config) and ship mtp.* "
                "tensors can draft. Use speculative_tokens=0."
            )
        self.drafter: Drafter = self.use(MTPDrafter())

    def use(self, drafter: Drafter) -> Drafter:
        drafter.bind(self)
        self.drafter = drafter
        return drafter

    @torch.inference_mode()
    def observe(self, runs: list[Run], hidden: torch.Tensor) -> None:
        """Every main forward outside verification (prefill chunks) passes its hidden states here."""
        self.drafter.observe(self, runs, hidden)

    @torch.inference_mode()
    def step(self, items: list[tuple[int, int, SamplingParams]]):
        """items: (slot, token, sampling), already validated -> (tokens per item, logits [B, V], positions)."""
        eng = self.engine
        slots = eng.cache.slots
        rows = [
            Row(s, slots[s].position, tok, sp, max(0, min(self.k, eng.options.max_seq_len - slots[s].position - 1)))
            for s, tok, sp in items
        ]
        drafts = self.drafter.draft(self, rows)
        for r, d in zip(rows, drafts.tokens):
            del d[r.k :]
            bad = [t for t in d if not isinstance(t, int) or not 0 <= t < eng.cfg.vocab_size]
            if bad:
                raise ValueError(f"drafter {self.drafter.name!r} proposed token(s) outside the vocabulary: {bad[:5]}")
        runs = [Run(r.slot, r.position, [r.token] + d) for r, d in zip(rows, drafts.tokens)]
        run = eng.graphs.replay("verify", self._verify_step, runs) if self._graphed(runs) else None
        if run is not None:
            run.graphed = [] if run.graphed is None else run.graphed
            hidden, logits = run.hidden[: len(rows)], run.logits[: len(rows)]
        else:
            ctx = ForwardContext.build(runs, eng.cache.scratch, eng.options.device)
            run = self._verify_step(ctx, min(len(fed) for _, _, fed in runs))
            hidden, logits = run.hidden, run.logits
        eng.forward_count += 1
        emitted, kept = accept(logits, rows, drafts)
        self._roll_back(run, runs, kept)
        for r, (_, _, fed), c in zip(rows, runs, kept):
            slots[r.slot].extend(fed[:c])
        self.drafter.commit(self, rows, kept, hidden)
        self.stats.steps += 1
        self.stats.rows += len(rows)
        self.stats.drafted += sum(len(d) for d in drafts.tokens)
        self.stats.accepted += sum(c - 1 for c in kept)
        self.stats.emitted += sum(kept)
        last = logits[torch.arange(len(rows), device=logits.device), torch.tensor(kept, device=logits.device) - 1]
        return emitted, last, [r.position + c for r, c in zip(rows, kept)]

    def _graphed(self, runs: list[Run]) -> bool:
        """The verify step replays a CUDA graph when the engine captures graphs, its per-token delta rule is
        capturable (the in-place Triton step or our torch one; fla's is not captured) and every run, padded to
        the longest (padding positions count as real; what they write is never kept), still fits in its slot."""
        eng, T = self.engine, max(len(run.tokens) for run in runs)
        capturable = getattr(eng.model, "in_place", False) or backend_name(eng.options.device) == "torch"
        return (
            eng.graphs is not None
            and self.rollback == "states"
            and capturable
            and all(run.start + T <= eng.options.max_seq_len for run in runs)
        )

    def _verify_step(self, ctx: ForwardContext, shortest: int | None = None) -> VerifyRun:
        """The main-model forward over every fed run, keeping what a rollback needs (eager, or captured: then
        every position is real). shortest: the fewest tokens any run feeds (None: all of them)."""
        eng = self.engine
        shortest = ctx.tokens.shape[1] if shortest is None else shortest
        if eng.model.kernels.delta_rule_in_place:  # the layers' own per-token kernels keep every state
            ctx = replace(ctx, gdn_log={}, state_history=[])
            states = ctx.state_history
        elif self.rollback == "states":
            rule = _StatesRule(shortest, getattr(eng.model, "in_place", False))
            ctx, states = replace(ctx, gdn_log={}, delta_rule=rule), rule.states
        else:
            ctx, states = replace(ctx, gdn_log={}), None
        hidden = eng.model.forward(ctx, eng.cache)
        return VerifyRun(ctx, hidden, eng.model.logits(hidden), ctx.gdn_log, states)

    def _roll_back(self, run: VerifyRun, runs: list[Run], kept: list[int]) -> None:
        """Gated DeltaNet conv and recurrent state of every slot that rejected something -> after its kept tokens.
        A replayed verify graph ran every row over T tokens, so there every row short of T is restored, by a
        second graph captured with it (eagerly should that capture fail)."""
        T, graphed = run.ctx.tokens.shape[1], run.graphed is not None
        short = [b for b, ((_, _, fed), c) in enumerate(zip(runs, kept)) if c < (T if graphed else len(fed))]
        if not short or not run.log:
            return
        if graphed and self._restore_graph(run):
            graph, rows, keep = run.graphed
            keep.copy_(torch.tensor(kept + [T] * (len(rows) - len(kept))))
            graph.replay()
            return
        idx = torch.tensor(short, device=run.ctx.slot_ids.device)
        self._restore(
            run.ctx.slot_ids[idx], idx, torch.tensor([kept[b] for b in short], device=idx.device), run.log, run.states
        )

    def _restore_graph(self, run: VerifyRun) -> bool:
        """Capture (once per verify graph) the rollback of every row; False if that capture failed."""
        if not run.graphed:
            rows = torch.arange(run.ctx.tokens.shape[0], device=run.ctx.slot_ids.device)
            keep = torch.full_like(rows, run.ctx.tokens.shape[1])  # while capturing every row keeps all: a no-op
            try:
                graph, _ = self.engine.graphs.capture(
                    lambda: self._restore(run.ctx.slot_ids, rows, keep, run.log, run.states)
                )
            except RuntimeError:
                run.graphed.append(None)
                return False
            run.graphed.extend([graph, rows, keep])
        return run.graphed[0] is not None

    def _restore(self, slots, rows, keep, log: dict, states) -> None:
        """Conv window and recurrent state of slots[i] (verify batch row rows[i]) -> after its first keep[i]
        fed tokens: the window is the last K-1 inputs of [start window | kept inputs]; the state is the kept
        per-position one, or the rule re-run from the start state over the kept tokens (rollback "replay")."""
        cache = self.engine.cache
        for n, (layer, (qkv_in, conv0, args)) in enumerate(log.items()):
            window = window_at(conv_inputs(conv0[rows], qkv_in[rows]), keep, conv0.shape[-1])
            cache.conv[layer][slots] = window.to(conv0.dtype)
            if states is not None:
                cache.rec[layer][slots] = states[n][rows, keep - 1]
            else:
                q, k, v, g, beta, rec0 = (x[rows] for x in args)
                cache.rec[layer][slots] = gated_delta_rule(q, k, v, g, beta, rec0, keep)[1]


@dataclass
class VerifyRun:
    """What one verify forward leaves for accepting and rolling back; static buffers when it was a graph."""

    ctx: ForwardContext  # the verify forward's context (its hooks on)
    hidden: torch.Tensor  # [B, T, hidden] final-normed
    logits: torch.Tensor  # [B, T, vocab] float32
    log: dict  # per GDN layer: (conv inputs, start window, delta-rule inputs and start state)
    states: list[torch.Tensor] | None  # rollback "states": per GDN layer the state after every fed token
    graphed: list | None = None  # replayed graph: [], then [rollback graph, rows, keep] once captured ([None]: failed)
