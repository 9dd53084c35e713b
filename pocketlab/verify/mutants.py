"""Engine mutants: deliberately broken engines that the verification checks must FAIL, so the suite shows that
its verdicts can fail rather than assuming it (notebook 07).

Each mutant is one realistic, small bug of the kind a slot engine has had or could have, switched on by a
context manager that monkeypatches one method or function for its duration: the runtime path never checks
for a mutant. Each declares the checks meant to catch it (`Mutant.targets`). `catch_matrix` runs every check
on the correct engine (it must pass) and against the mutants (each targeted one must fail it), and measures
how subtle each bug is: its effect on the logits of the first step it touches, relative to the logit scale.

    from pocketlab.verify.mutants import catch_matrix
    r = catch_matrix("tiny-qwen3")      # Report: summary (one row per check), tables matrix / cells / effects
    python -m pocketlab.verify.mutants --model qwen3-0.6b --device cuda   # the same on a GPU (bf16)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import cast

import pandas as pd
import torch
import torch.nn.functional as F

from .. import engine as engine_module
from .. import prefix_cache as prefix_module
from ..cache import SlotCache
from ..config import ModelConfig
from ..layers.gated_delta import conv_inputs, gated_delta_rule, window_at
from ..layers.linear import composed
from ..layers.moe import SparseMoE
from ..models import qwen3 as qwen3_module
from ..models.qwen3 import Attention
from ..requests import BatchedRequest
from ..sampling import SamplingParams
from ..speculative.speculator import Speculator
from .batch_api import batch_api
from .common import Pair, Report, as_pair, random_prompts
from .invariance import invariance
from .isolation import isolation
from .mtp import checked_model, greedy_equality
from .mtp_runs import mtp_engine, use_drafter
from .parity import parity
from .prefix import prefix_cache


# -- patching ------------------------------------------------------------------------------------
@contextlib.contextmanager
def patched(owner, name: str, value) -> Iterator[None]:
    """owner.name = value for the duration (a class attribute or a module global), restored however it ends."""
    before = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)


def _last_attention_layer(cache: SlotCache) -> int:
    """The mutated attention layer: the model's last one (the smallest effect on the logits)."""
    return max(k for k in cache.k if isinstance(k, int))


# -- the mutants ---------------------------------------------------------------------------------
def _kv_other_slot():
    """In the last attention layer each row reads the NEXT slot's key and value at position 0 (a slot-stride
    bug in one layer's gather). Rows whose position 0 this forward writes are spared, so prompts look right."""
    original = Attention.__call__

    def call(self, h, norm, ctx, cache):
        if self.kv_key != _last_attention_layer(cache):
            return original(self, h, norm, ctx, cache)
        k, v, slots = cache.k[self.kv_key], cache.v[self.kv_key], ctx.slot_ids
        other, stale = (slots + 1) % k.shape[0], (ctx.start > 0)[:, None, None]
        own_k, own_v = k[slots, :, 0].clone(), v[slots, :, 0].clone()
        k[slots, :, 0] = torch.where(stale, k[other, :, 0], own_k)
        v[slots, :, 0] = torch.where(stale, v[other, :, 0], own_v)
        try:
            return original(self, h, norm, ctx, cache)
        finally:  # only the read was wrong: the slot's own rows are put back
            k[slots, :, 0] = torch.where(stale, own_k, k[slots, :, 0])
            v[slots, :, 0] = torch.where(stale, own_v, v[slots, :, 0])

    return patched(Attention, "__call__", call)


def _shared_position():
    """In the last attention layer a batched decode step rotates every row (RoPE) at row 0's position: the seed
    engine's shared `position_`, surviving in one layer's rotary lookup. K/V still land at each row's position."""
    original = Attention.__call__

    def call(self, h, norm, ctx, cache):
        B, T = ctx.tokens.shape
        if T != 1 or B < 2 or self.kv_key != _last_attention_layer(cache):
            return original(self, h, norm, ctx, cache)
        rope, positions = ctx.rope, ctx.positions
        if rope is None:  # the decode kernel reads each row's position in the rope tables
            ctx.positions = positions[:1].expand_as(positions)
        else:
            ctx.rope = tuple(t[:1].expand_as(t).contiguous() for t in rope)
        try:
            return original(self, h, norm, ctx, cache)
        finally:
            ctx.rope, ctx.positions = rope, positions

    return patched(Attention, "__call__", call)


def _stale_prefix_block():
    """The prefix cache matches whole blocks: a prompt that diverges inside a block reuses the cached K/V (or
    state checkpoint) up to that block's end, one block too far, and computes only the rest."""
    original_len, original_prepare, block = prefix_module.common_len, prefix_module.PrefixCache.prepare, [0]

    def common_len(a, b, limit=None, known=0):
        n = original_len(a, b, limit, known)
        end = min(len(a), len(b), len(b) if limit is None else limit)
        return min(end, (n // block[0] + 1) * block[0]) if block[0] and n < end else n

    def prepare(self, slot, prompt):
        block[0] = self.block
        try:
            return original_prepare(self, slot, prompt)
        finally:
            block[0] = 0

    @contextlib.contextmanager
    def both():
        with patched(prefix_module, "common_len", common_len), patched(prefix_module.PrefixCache, "prepare", prepare):
            yield

    return both()


def _snapshot_without_recurrent_state():
    """restore() copies tokens, K/V and conv windows but leaves the slot's Gated DeltaNet recurrent state as it
    was (the fp32 state tensors were forgotten in the list of what a snapshot restores)."""
    original = SlotCache.restore

    def restore(self, snap, slot):
        kept = {i: self.rec[i][slot].clone() for i in self.rec}
        original(self, snap, slot)
        for i, state in kept.items():
            self.rec[i][slot] = state

    return patched(SlotCache, "restore", restore)


def _kv_written_late():
    """In the last attention layer a one-token step's K/V lands one position late: the next step overwrites it
    before reading, so each step misses the previous token's key and sees a stale row instead."""
    original = Attention.__call__

    def call(self, h, norm, ctx, cache):
        if h.shape[1] != 1 or self.kv_key != _last_attention_layer(cache):
            return original(self, h, norm, ctx, cache)
        k, v, slots, pos = cache.k[self.kv_key], cache.v[self.kv_key], ctx.slot_ids, ctx.start
        late = (pos + 1).clamp(max=k.shape[2] - 1)
        old_k, old_v = k[slots, :, pos].clone(), v[slots, :, pos].clone()
        out = original(self, h, norm, ctx, cache)
        new_k, new_v = k[slots, :, pos].clone(), v[slots, :, pos].clone()
        k[slots, :, late], v[slots, :, late] = new_k, new_v
        k[slots, :, pos], v[slots, :, pos] = old_k, old_v
        return out

    return patched(Attention, "__call__", call)


def _rollback_keeps_rejected():
    """The MTP rollback sets each Gated DeltaNet recurrent state to the one after the first REJECTED token
    (an off-by-one in the kept count) instead of after the last kept one; the conv windows are right."""

    def restore(self, slots, rows, keep, gdn_log, states):
        cache = self.engine.cache
        for n, (layer, (qkv_in, conv0, args)) in enumerate(gdn_log.items()):
            window = window_at(conv_inputs(conv0[rows], qkv_in[rows]), keep, conv0.shape[-1])
            cache.conv[layer][slots] = window.to(conv0.dtype)
            fed = qkv_in.shape[1]
            late = (keep + 1).clamp(max=fed)
            if states is not None:
                cache.rec[layer][slots] = states[n][rows, late - 1]
            else:
                q, k, v, g, beta, rec0 = (x[rows] for x in args)
                cache.rec[layer][slots] = gated_delta_rule(q, k, v, g, beta, rec0, late)[1]

    return patched(Speculator, "_restore", restore)


def _sampling_by_row():
    """Sampling draws its uniform from the request's batch ROW instead of its own seed: a request samples
    different tokens in a batch than alone. Logits are untouched (greedy is unaffected)."""
    original = engine_module.sample

    def sample(logits, params, positions):
        return original(logits, [dataclasses.replace(p, seed=b) for b, p in enumerate(params)], positions)

    return patched(engine_module, "sample", sample)


def _split_k_by_batch():
    """The batch-invariant mode's matmul splits K in a number of pieces that follows the batch's row count, as
    cuBLAS picks its split-K by shape: each row's sum is reassociated, a last-bit change (batch-invariant
    engines only)."""
    original = qwen3_module.kernels_for

    def matmul(x, w, bias=None):
        parts = 1 + x.reshape(-1, x.shape[-1]).shape[0] % 3
        pieces = zip(x.tensor_split(parts, -1), w.tensor_split(parts, -1), strict=True)
        y = sum(F.linear(xs, ws) for xs, ws in pieces)
        return y if bias is None else y + bias

    def kernels_for(options):
        kernels = original(options)
        if not options.batch_invariant:
            return kernels
        from ..layers.invariant import swiglu

        return dataclasses.replace(kernels, linear=functools.partial(composed, matmul, activation=swiglu))

    return patched(qwen3_module, "kernels_for", kernels_for)


def _expert_capacity():
    """The MoE router keeps at most ceil(pairs / experts) (token, k) pairs per expert in each forward, in token
    order, and drops the rest (their routing weight 0): the capacity limit of MoE training. A token alone never
    loses a pair (its k experts differ), so its output comes to follow what else the forward holds."""
    original = SparseMoE.__call__

    def call(self, h, norm):
        route = self.route

        def capped(logits, top_k, renormalize):
            weights, ids = route(logits, top_k, renormalize)
            flat = ids.reshape(-1)
            rank = (F.one_hot(flat, self.num_experts).cumsum(0) - 1).gather(1, flat[:, None])[:, 0]
            keep = rank < -(-flat.numel() // self.num_experts)
            return weights * keep.view_as(weights).to(weights.dtype), ids

        self.route = capped
        try:
            return original(self, h, norm)
        finally:
            self.route = route

    return patched(SparseMoE, "__call__", call)


@dataclass(frozen=True)
class Mutant:
    """One deliberate bug: `install()` is a context manager that breaks the engine while active."""

    name: str
    bug: str
    install: Callable[[], contextlib.AbstractContextManager]
    targets: tuple[str, ...]  # the checks meant to catch it
    needs: str = ""  # "hybrid": Gated DeltaNet state; "moe": experts; "speculative" / "batch_invariant": those engines


MUTANTS = {
    m.name: m
    for m in (
        Mutant(
            "kv_other_slot",
            "last attention layer reads the next slot's K/V at position 0",
            _kv_other_slot,
            ("parity", "isolation", "batch_api", "invariance"),
        ),
        Mutant(
            "shared_position",
            "last attention layer rotates batched decode rows at row 0's position",
            _shared_position,
            ("batch_api", "invariance"),
        ),
        Mutant(
            "stale_prefix_block",
            "prefix cache reuses a diverging prompt up to the end of its block",
            _stale_prefix_block,
            ("prefix_cache",),
        ),
        Mutant(
            "snapshot_no_recurrent",
            "restore() leaves the recurrent state as it was",
            _snapshot_without_recurrent_state,
            ("isolation",),
            needs="hybrid",
        ),
        Mutant(
            "kv_written_late",
            "one-token steps write K/V one position late (last attention layer)",
            _kv_written_late,
            ("parity",),
        ),
        Mutant(
            "rollback_keeps_rejected",
            "MTP rollback keeps the first rejected token's recurrent state",
            _rollback_keeps_rejected,
            ("speculative",),
            needs="speculative",
        ),
        Mutant(
            "split_k_by_batch",
            "batch-invariant matmul splits K by the batch's row count",
            _split_k_by_batch,
            ("invariance",),
            needs="batch_invariant",
        ),
        Mutant(
            "expert_capacity",
            "MoE router drops pairs past ceil(pairs / experts) per expert in a forward",
            _expert_capacity,
            ("parity", "batch_api", "invariance"),
            needs="moe",
        ),
        Mutant(
            "sampling_by_row",
            "sampling uniforms keyed by batch row, not by request seed",
            _sampling_by_row,
            ("batch_api",),
        ),
    )
}

# (mutant, check) -> why a targeted check cannot see it here; a miss not listed here fails the matrix
EXPLAINED: dict[tuple[str, str], str] = {}
# (mutant, check) -> why a default-mode check cannot see it in 16 bits; it counts only in a bf16/fp16 matrix
# whose bitwise invariance check caught the same mutant, so every miss is still caught by some check
BELOW_16_BIT_NOISE: dict[tuple[str, str], str] = {
    ("shared_position", "batch_api"): "in 16 bits batched rows differ from solo ones by rounding noise, and the "
    "calibrated bound (2x the engine's own |16-bit - float32| distance) exceeds this bug's effect (one layer's RoPE "
    "at another row's position: 1.5% of max|logit| at the Qwen3-0.6B shape on the H200); the bitwise invariance "
    "check catches it",
}


# -- the checks, sized for the matrix ------------------------------------------------------------
def _speculative(pair: Pair, steps: int) -> Report:
    """Greedy speculative decoding == plain greedy with drafters that reject (so every step rolls back)."""
    model, _ = checked_model(pair.name)
    device = pair.device
    df = greedy_equality(
        model,
        device,
        "float32",
        ks=(2,),
        drafters=("adversarial", "oracle@0.5"),
        new_tokens=4 * steps,
        cuda_graphs=False,
    )
    return Report("speculative", df.assign(model=model), {"equality": df}, dict(model=model))


# name -> check(pair, decode steps, slots); small shapes: the matrix runs each check up to 1 + 7 times
CHECKS: dict[str, Callable[[Pair, int, int], Report]] = {
    "parity": lambda pair, steps, slots: parity(pair, prompt_lens=[1, 7, 9, 21], decode_steps=steps),
    "isolation": lambda pair, steps, slots: isolation(pair, num_slots=slots, decode_steps=steps),
    "batch_api": lambda pair, steps, slots: batch_api(pair, num_slots=slots, decode_steps=steps),
    "prefix_cache": lambda pair, steps, slots: prefix_cache(pair),
    "speculative": lambda pair, steps, slots: _speculative(pair, steps),
    "invariance": lambda pair, steps, slots: invariance(
        pair, num_slots=slots, steps=2, batch_invariant=True, cases=("batched", "interleaved")
    ),
}
EXPENSIVE = {"invariance"}  # runs only against the mutants it targets unless full="all"


def _config(pair: Pair) -> ModelConfig:
    return ModelConfig.from_dict(pair.hf.config.to_dict())


def _hybrid(pair: Pair) -> bool:
    return bool(_config(pair).linear_layers)


def _moe(pair: Pair) -> bool:
    return bool(_config(pair).num_experts)


def applies(mutant: Mutant, check: str, pair: Pair) -> bool:
    """Does the mutant's code run at all in this check's engines? (The speculative check runs on a hybrid
    MTP model whatever the pair.)"""
    if mutant.needs == "moe":
        return check != "speculative" and _moe(pair)
    if mutant.needs == "speculative":
        return check == "speculative"
    if mutant.needs == "batch_invariant":
        return check == "invariance"
    if mutant.needs == "hybrid":
        return check == "speculative" or _hybrid(pair)
    return True


def without_graphs(pair: Pair) -> Pair:
    """The pair with CUDA graphs off: a mutant patches eager Python, which a replayed graph would skip. The
    correct engine runs the same way, so every cell compares like with like."""
    make = pair.make
    return dataclasses.replace(pair, make=lambda opts: make(dataclasses.replace(opts, cuda_graphs=False)))


# -- how subtle: each mutant's effect on one step's logits ---------------------------------------
def _scenario(new_engine, vocab: int, seed: int) -> list[tuple[str, int, torch.Tensor]]:
    """(step, token, logits) of a fixed little workload that touches every mutated path: two prompts, a batched
    decode, a single decode, a snapshot put back, a prompt diverging inside a cached block, a sampled batch."""
    eng = new_engine()
    a, b = random_prompts(vocab, [20, 9], seed + 5)
    out = []

    def add(label, r):
        out.append((label, int(r.next_token), r.logits.detach().float().cpu().clone()))

    add("prefill slot 1", eng.prefill(a, slot_id=1))
    add("prefill slot 0", eng.prefill(b, slot_id=0))
    reqs = [BatchedRequest(0, b, slot_id=0, generated_tokens=[out[1][1]])]
    reqs.append(BatchedRequest(1, a, slot_id=1, generated_tokens=[out[0][1]]))
    res = eng.batch_decode_step(reqs)
    for i in range(len(reqs)):
        out.append((f"batched decode, row {i}", res.next_tokens[i], res.logits[i].float().cpu().clone()))
    add("decode slot 0", eng.decode_step(res.next_tokens[0], slot_id=0))
    snap = eng.snapshot(0)
    eng.reset(0)
    eng.restore(snap, 0)
    add("decode slot 0 after snapshot/restore", eng.decode_step(out[-1][1], slot_id=0))
    feed = [out[-1][1], res.next_tokens[1]]
    add("prefill diverging inside a cached block", eng.prefill(a[:13] + [(a[13] + 1) % vocab] + a[14:], slot_id=2))
    hot = [SamplingParams(temperature=2.0, seed=1000 + i) for i in range(2)]
    reqs = [
        BatchedRequest(10 + i, p, slot_id=i, sampling=sp, generated_tokens=[t])
        for i, (p, sp, t) in enumerate(zip((b, a), hot, feed, strict=True))
    ]
    res = eng.batch_decode_step(reqs)
    for i in range(2):
        out.append((f"sampled batched decode, row {i}", res.next_tokens[i], res.logits[i].float().cpu().clone()))
    return out


def _speculative_scenario(new_engine, vocab: int, seed: int) -> list[tuple[str, int, torch.Tensor]]:
    """Speculative greedy decoding with a drafter that is always wrong: every step rolls back."""
    eng = new_engine()
    prompt = random_prompts(vocab, [9], seed + 5)[0]
    use_drafter(eng, "adversarial", {0: prompt + [0] * 64})
    r, out = eng.prefill(prompt), []
    out.append(("prefill", r.next_token, r.logits.float().cpu().clone()))
    for k in range(6):
        r = eng.decode_step(r.next_token)
        out.append((f"speculative decode {k}", r.next_token, r.logits.float().cpu().clone()))
    return out


def _effect(steps_ok, steps_bad) -> dict:
    """The first step whose logits or token the mutant changed, and by how much relative to max |logit|."""
    for (label, tok, ref), (_, tok2, got) in zip(steps_ok, steps_bad, strict=True):
        if tok != tok2 or not torch.equal(ref, got):
            diff = float((got - ref).abs().max())
            return dict(
                first_changed_step=label,
                max_abs_effect=diff,
                rel_effect=diff / max(float(ref.abs().max()), 1e-30),
                token_changed=tok != tok2,
            )
    return dict(first_changed_step="(none)", max_abs_effect=0.0, rel_effect=0.0, token_changed=False)


def effects(pair: Pair, mutants=MUTANTS, seed: int = 0) -> pd.DataFrame:
    """Per mutant: the first step of a fixed workload it changes, correct vs mutated engine, and how much."""
    opts = dict(max_slots=3, max_seq_len=128, prefill_chunk=8, prefix_block=4, checkpoint_stride=8)
    rows = []
    for m in mutants.values():
        if m.needs == "speculative":
            model, _ = checked_model(pair.name)
            make, vocab = mtp_engine(model, pair.device, "float32", seed, cuda_graphs=False)
            new = functools.partial(make, speculative_tokens=2, **opts)
            run = functools.partial(_speculative_scenario, new, vocab, seed)
        elif m.needs == "hybrid" and not _hybrid(pair):
            rows.append(dict(mutant=m.name, bug=m.bug, first_changed_step="n/a (no recurrent state)"))
            continue
        elif m.needs == "moe" and not _moe(pair):
            rows.append(dict(mutant=m.name, bug=m.bug, first_changed_step="n/a (no experts)"))
            continue
        else:
            model = pair.name
            mode = dict(batch_invariant=True) if m.needs == "batch_invariant" else {}
            new = functools.partial(pair.engine, **opts, **mode)
            run = functools.partial(_scenario, new, pair.vocab_size, seed)
        ok = run()
        with m.install():
            bad = run()
        rows.append(dict(mutant=m.name, bug=m.bug, model=model, **_effect(ok, bad)))
    return pd.DataFrame(rows)


# -- the matrix ----------------------------------------------------------------------------------
def _run_check(name: str, pair: Pair, steps: int, slots: int) -> tuple[bool, str]:
    """(passed, failing parts) for one check; a check that raises has failed."""
    try:
        r = CHECKS[name](pair, steps, slots)
    except Exception as e:  # noqa: BLE001 - a mutant that crashes a check is caught by it
        return False, f"raised {type(e).__name__}: {str(e)[:120]}"
    bad = r.summary[~r.summary["pass"]]
    what = [str(v) for v in bad.iloc[:, 0].tolist()[:3]]
    return r.passed, "; ".join(what)


def catch_matrix(
    model="tiny-qwen3",
    device: str = "cpu",
    dtype: str = "float32",
    seed: int = 0,
    steps: int = 4,
    slots: int = 3,
    checks=tuple(CHECKS),
    mutants=tuple(MUTANTS),
    full: bool | str = True,
) -> Report:
    """Every check on the correct engine (must pass) and against the mutants (each must fail the checks it
    targets). full=False: only targeted cells; True: every applicable cell but the EXPENSIVE checks'
    untargeted ones; "all": every applicable cell. Tables: `matrix` (check x mutant: caught / MISSED /
    not caught (untargeted) / n/a), `cells` (one row per run), `effects` (how subtle each mutant is)."""
    unknown = [c for c in checks if c not in CHECKS] + [m for m in mutants if m not in MUTANTS]
    if unknown:
        raise ValueError(f"unknown checks or mutants {unknown}; checks: {list(CHECKS)}, mutants: {list(MUTANTS)}")
    if full not in (True, False, "all"):
        raise ValueError(f"full={full!r}: use True, False or 'all'")
    if steps < 2 or slots < 2:
        raise ValueError(f"steps={steps}, slots={slots}: the checks need at least 2 of each")
    pair = without_graphs(as_pair(model, device, dtype, seed))
    chosen = {m: MUTANTS[m] for m in mutants}
    cells = []
    for check in checks:
        passed, why = _run_check(check, pair, steps, slots)
        cells.append(dict(check=check, mutant="(correct engine)", targeted=True, passed=passed, detail=why))
        for m in chosen.values():
            targeted = check in m.targets
            if not applies(m, check, pair):
                cells.append(dict(check=check, mutant=m.name, targeted=targeted, passed=None, detail="n/a"))
                continue
            if not targeted and (full is False or (full is True and check in EXPENSIVE)):
                continue
            with m.install():
                passed, why = _run_check(check, pair, steps, slots)
            cells.append(dict(check=check, mutant=m.name, targeted=targeted, passed=passed, detail=why))
    cells = pd.DataFrame(cells)
    cells["explained"] = [_explanation(c, cells, pair.dtype) for c in cells.itertuples()]
    cells["outcome"] = [_outcome(c) for c in cells.itertuples()]
    matrix = cells.pivot(index="check", columns="mutant", values="outcome").reindex(
        index=list(checks), columns=["(correct engine)", *chosen]
    )
    matrix = matrix.astype(object).where(matrix.notna(), "not run")
    summary = []
    for check in checks:
        c = cells[cells.check == check]
        correct = c[c.mutant == "(correct engine)"].iloc[0]
        targeted = c[(c.mutant != "(correct engine)") & c.targeted & c.passed.notna()]
        missed = targeted[targeted.passed.astype(bool)]
        unexplained = missed[missed.explained == ""]
        summary.append(
            dict(
                check=check,
                correct_engine="PASS" if correct.passed else f"FAIL: {correct.detail}",
                targeted=len(targeted),
                caught=len(targeted) - len(missed),
                missed=", ".join(missed.mutant) or "",
                also_caught=", ".join(c[(~c.targeted) & (c.passed == False)].mutant),  # noqa: E712
                **{"pass": bool(correct.passed) and unexplained.empty},
            )
        )
    summary = pd.DataFrame(summary)
    eff = effects(pair, chosen, seed)
    targeted = cells[(cells.mutant != "(correct engine)") & cells.targeted & cells.passed.notna()]
    figures = dict(
        model=pair.name,
        dtype=pair.dtype,
        mutants=len(chosen),
        targeted_cells=len(targeted),
        caught=int((targeted.passed == False).sum()),  # noqa: E712
        missed=", ".join(f"{c.mutant}/{c.check}" for c in targeted[targeted.passed.astype(bool)].itertuples()),
        correct_engine_passes=bool(cells[cells.mutant == "(correct engine)"].passed.all()),
        max_rel_effect=float(eff.get("rel_effect", pd.Series([0.0])).max()),
    )
    return Report("mutants", summary, {"matrix": matrix, "cells": cells, "effects": eff}, figures)


def _explanation(c, cells: pd.DataFrame, dtype: str) -> str:
    """Why a targeted cell may miss: EXPLAINED, or in 16 bits BELOW_16_BIT_NOISE once invariance caught it."""
    if (c.mutant, c.check) in EXPLAINED:
        return EXPLAINED[c.mutant, c.check]
    bitwise = cells[(cells.check == "invariance") & (cells.mutant == c.mutant) & (cells.passed == False)]  # noqa: E712
    return BELOW_16_BIT_NOISE.get((c.mutant, c.check), "") if dtype != "float32" and len(bitwise) else ""


def _outcome(c) -> str:
    if c.passed is None:
        return "n/a"
    if c.mutant == "(correct engine)":
        return "PASS" if c.passed else "FAIL"
    if c.targeted:
        return ("missed (explained)" if c.explained else "MISSED") if c.passed else "caught"
    return "not caught (untargeted)" if c.passed else "caught (untargeted)"


def main(argv=None) -> int:
    """The catch matrix for one model on one device: prints it and the mutants' effects; exit 1 unless the
    correct engine passes every check and every targeted mutant is caught (or its miss explained)."""
    ap = argparse.ArgumentParser(prog="python -m pocketlab.verify.mutants", description=main.__doc__)
    ap.add_argument("--model", default="tiny-qwen3")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="", help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--slots", type=int, default=3)
    ap.add_argument("--full", default="", help="true / false / all (default: true on cpu, false on cuda)")
    ap.add_argument("--out", default="", help="CSV of every cell")
    a = ap.parse_args(argv)
    dtype = a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32")
    full = cast(
        "dict[str, bool | str]", {"": not a.device.startswith("cuda"), "true": True, "false": False, "all": "all"}
    ).get(a.full.lower())
    if full is None:
        raise ValueError(f"--full {a.full!r}: use true, false or all")
    r = catch_matrix(a.model, a.device, dtype, steps=a.steps, slots=a.slots, full=full)
    with pd.option_context("display.width", 250, "display.max_columns", 20, "display.max_colwidth", 60):
        print(r.tables["matrix"].to_string())
        print(r.summary.to_string(index=False))
        print(r.tables["effects"].to_string(index=False))
    print(f"verdict: {'PASS' if r.passed else 'FAIL'} ({r.figures['caught']}/{r.figures['targeted_cells']} caught)")
    if a.out:
        r.tables["cells"].to_csv(a.out, index=False)
    return 0 if r.passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
