"""The engine's speculative decode step: draft, verify every slot in ONE main-model forward, accept, roll back.

Roll back: a slot that kept a+1 of its k+1 fed tokens has its token history (and so its attention KV, masked
by position) cut to n+a+1, and each Gated DeltaNet layer's conv window and recurrent state set to those after
token n+a. The verify forward keeps, per GDN layer, the states it started from and its inputs; the conv window
is the last K-1 inputs of [start window | kept inputs]. The recurrent state (EngineOptions.speculative_rollback):
  "states" (default): the verify forward runs the delta rule token by token (plain decoding's own arithmetic)
           and keeps every intermediate state ([B, k+1, H, dk, dv] fp32 per layer); rollback is an index.
  "replay": the verify forward runs the usual chunked rule; slots that rejected something re-run it from the
           saved start state over their kept tokens: fewer state bytes, more launches.
`verify.mtp_cost.verify_cost` measures both on a device.

CUDA graphs (rollback "states"): the verify forward replays a graph per (batch bucket, k+1, key bucket), every
row running the longest run's k+1 tokens (what padding writes lies past the slot's tokens and is never kept);
the rollback is a second graph that restores every row that kept fewer than k+1.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import cast

import torch

from ..forward import ForwardContext, Run
from ..layers.gated_delta import L2_EPS, backend_name, conv_inputs, gated_delta_rule, window_at
from ..layers.linear_decode import recurrent_step
from ..requests import Refusal
from ..sampling import SamplingParams, penalize
from .acceptance import accept
from .drafters import Drafter, MTPDrafter, Row


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
        """items: (slot, token, sampling), already validated -> (tokens per item, logits [B, V], positions).
        Runs one main-model forward (the engine counts it) besides the drafter's own."""
        eng = self.engine
        slots = eng.cache.slots
        rows = [
            Row(s, slots[s].position, tok, sp, max(0, min(self.k, eng.options.max_seq_len - slots[s].position - 1)))
            for s, tok, sp in items
        ]
        drafts = self.drafter.draft(self, rows)
        if len(drafts.tokens) != len(rows):
            raise Refusal(f"drafter {self.drafter.name!r} drafted for {len(drafts.tokens)} rows, not {len(rows)}")
        for r, d in zip(rows, drafts.tokens, strict=True):
            del d[r.k :]
            bad = [t for t in d if not isinstance(t, int) or not 0 <= t < eng.cfg.vocab_size]
            if bad:
                raise Refusal(f"drafter {self.drafter.name!r} proposed token(s) outside the vocabulary: {bad[:5]}")
        runs = [Run(r.slot, r.position, [r.token] + d) for r, d in zip(rows, drafts.tokens, strict=True)]
        run = eng.graphs.replay("verify", self._verify_step, runs) if self._graphed(runs) else None
        if run is not None:
            run.graphed = [] if run.graphed is None else run.graphed
            hidden, logits = run.hidden[: len(rows)], run.logits[: len(rows)]
        else:
            ctx = ForwardContext.build(runs, eng.cache.scratch, eng.options.device)
            run = self._verify_step(ctx, min(len(fed) for _, _, fed in runs))
            hidden, logits = run.hidden, run.logits
        emitted, kept = accept(self._penalized(logits, rows, runs), rows, drafts)
        self._roll_back(run, runs, kept)
        for r, (_, _, fed), c in zip(rows, runs, kept, strict=True):
            slots[r.slot].extend(fed[:c])
        self.drafter.commit(self, rows, kept, hidden)
        self.stats.steps += 1
        self.stats.rows += len(rows)
        self.stats.drafted += sum(len(d) for d in drafts.tokens)
        self.stats.accepted += sum(c - 1 for c in kept)
        self.stats.emitted += sum(kept)
        last = logits[torch.arange(len(rows), device=logits.device), torch.tensor(kept, device=logits.device) - 1]
        return emitted, last, [r.position + c for r, c in zip(rows, kept, strict=True)]

    def _penalized(self, logits: torch.Tensor, rows: list[Row], runs: list[Run]) -> torch.Tensor:
        """Target logits [B, T, V] with each row's repetition penalty (sampling.penalize): position j follows the
        slot's tokens and the fed tokens up to j. The drafts are proposals, so the drafter's q stays as drawn."""
        B, T, V = logits.shape
        slots = self.engine.cache.slots

        def history(i: int) -> list[int]:
            b, j = divmod(i, T)
            return [*slots[rows[b].slot].tokens, *runs[b].tokens[: j + 1]]

        params = [r.sampling for r in rows for _ in range(T)]
        return penalize(logits.reshape(B * T, V), params, history).view(B, T, V)

    def _capturable(self) -> bool:
        """The verify step replays a CUDA graph when the engine captures graphs and its per-token delta rule is
        capturable (the in-place Triton step or our torch one; fla's is not captured)."""
        eng = self.engine
        in_place = getattr(eng.model, "in_place", False) or backend_name(eng.options.device) == "torch"
        return eng.graphs is not None and self.rollback == "states" and in_place

    def _graphed(self, runs: list[Run]) -> bool:
        """Capturable, and every run, padded to the longest (padding positions count as real; what they write is
        never kept), still fits in its slot."""
        T = max(len(run.tokens) for run in runs)
        return self._capturable() and all(run.start + T <= self.engine.options.max_seq_len for run in runs)

    def graph_steps(self) -> list[tuple]:
        """(name, tokens per row, beyond, step, after) of every graph this speculator's steps replay, `after`
        called on a capture's outputs (or None): what warm-up captures."""
        verify = [("verify", self.k + 1, 0, self._verify_step, self._capture_rollback)] if self._capturable() else []
        return verify + self.drafter.graph_steps(self)

    def _capture_rollback(self, run: VerifyRun) -> None:
        """A verify graph's rollback graph, captured with it rather than at its first rejection."""
        run.graphed = [] if run.graphed is None else run.graphed
        if run.gdn_log:
            self._restore_graph(run)

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
        return VerifyRun(ctx, hidden, eng.model.logits(hidden), cast(dict, ctx.gdn_log), states)  # set above

    def _roll_back(self, run: VerifyRun, runs: list[Run], kept: list[int]) -> None:
        """Gated DeltaNet conv and recurrent state of every slot that rejected something -> after its kept tokens.
        A replayed verify graph ran every row over T tokens, so there every row short of T is restored, by a
        second graph captured with it (eagerly should that capture fail)."""
        T, graphed = run.ctx.tokens.shape[1], run.graphed is not None
        short = [
            b for b, ((_, _, fed), c) in enumerate(zip(runs, kept, strict=True)) if c < (T if graphed else len(fed))
        ]
        if not short or not run.gdn_log:
            return
        if graphed and self._restore_graph(run):
            assert run.graphed is not None  # graphed: a verify graph's run
            graph, rows, keep = run.graphed
            keep.copy_(torch.tensor(kept + [T] * (len(rows) - len(kept))))
            graph.replay()
            return
        idx = torch.tensor(short, device=run.ctx.slot_ids.device)
        self._restore(
            run.ctx.slot_ids[idx],
            idx,
            torch.tensor([kept[b] for b in short], device=idx.device),
            run.gdn_log,
            run.states,
        )

    def _restore_graph(self, run: VerifyRun) -> bool:
        """Capture (once per verify graph) the rollback of every row; False if that capture failed."""
        assert run.graphed is not None  # a verify graph's run
        if not run.graphed:
            rows = torch.arange(run.ctx.tokens.shape[0], device=run.ctx.slot_ids.device)
            keep = torch.full_like(rows, run.ctx.tokens.shape[1])  # while capturing every row keeps all: a no-op
            try:
                graph, _ = self.engine.graphs.capture(
                    lambda: self._restore(run.ctx.slot_ids, rows, keep, run.gdn_log, run.states)
                )
            except RuntimeError:
                run.graphed.append(None)
                return False
            run.graphed.extend([graph, rows, keep])
        return run.graphed[0] is not None

    def _restore(self, slots, rows, keep, gdn_log: dict, states) -> None:
        """Conv window and recurrent state of slots[i] (verify batch row rows[i]) -> after its first keep[i]
        fed tokens: the window is the last K-1 inputs of [start window | kept inputs]; the state is the kept
        per-position one, or the rule re-run from the start state over the kept tokens (rollback "replay")."""
        cache = self.engine.cache
        for n, (layer, (qkv_in, conv0, args)) in enumerate(gdn_log.items()):
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
    gdn_log: dict  # per GDN layer: (conv inputs, start window, delta-rule inputs and start state)
    states: list[torch.Tensor] | None  # rollback "states": per GDN layer the state after every fed token
    graphed: list | None = None  # replayed graph: [], then [rollback graph, rows, keep] once captured ([None]: failed)
