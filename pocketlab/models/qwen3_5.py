"""Qwen3.5 hybrid decoder: Gated DeltaNet (linear attention) layers with every 4th a gated full attention."""

from __future__ import annotations

from itertools import pairwise
from typing import cast

import torch

from ..cache import SlotCache
from ..config import ModelConfig
from ..forward import ForwardContext
from ..layers.decode_attention import available as triton_available
from ..layers.gated_delta import (
    L2_EPS,
    backend_name,
    causal_conv1d,
    conv_inputs,
    gated_delta_rule,
    gated_delta_rule_segments,
)
from ..layers.kernels import Kernels
from ..layers.linear_decode import ConvStep, conv_steps, recurrent_step, recurrent_steps
from .qwen3 import Attention, DecoderModel


class GatedDeltaNet:
    """Linear attention whose per-slot state (conv window + fp32 delta-rule matrix) lives in the SlotCache.
    `in_place`: one-token steps run the Triton kernels that update each slot's state where it lives, and so do
    forwards of at most `in_place_tokens` tokens (prompts, chunks; not a speculative verify), token by token: two
    launches a layer instead of the chunked rule's dozen. With batch-invariant kernels every token does (see
    `_run_invariant`)."""

    def __init__(self, cfg: ModelConfig, w: dict, p: str, layer: int, kernels: Kernels, in_place: bool = False,
                 in_place_tokens: int = 0):  # fmt: skip
        self.cfg, self.layer, self.kernels, self.in_place = cfg, layer, kernels, in_place
        self.in_place_tokens = in_place_tokens if in_place else 0
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        names = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
        self.in_proj = torch.cat([w.pop(f"{p}{n}.weight") for n in names])  # one matmul for all four
        self.splits = [2 * self.hk * self.dk + self.hv * self.dv, self.hv * self.dv, self.hv, self.hv]
        self.conv_weight = w.pop(p + "conv1d.weight").squeeze(1)
        self.neg_A = -w.pop(p + "A_log").float().exp()
        self.dt_bias = w.pop(p + "dt_bias").float()
        self.norm = w.pop(p + "norm.weight")
        self.out = w.pop(p + "out_proj.weight")

    @property
    def normed_weight(self) -> torch.Tensor:
        return self.in_proj

    def __call__(self, h, norm, ctx: ForwardContext, cache: SlotCache):
        """h + gated_delta_net(norm(h)): the norm inside in_proj's kernel and a decode step's conv in its epilogue,
        the add inside out_proj's, where they fuse."""
        B, T, _ = h.shape
        conv, rec = cache.conv[self.layer], cache.rec[self.layer]
        conv_into, rec_into = cache.aside(self.layer, B) if ctx.states_aside else (None, None)
        invariant = self.kernels.delta_rule_in_place
        plain = ctx.delta_rule is None and ctx.gdn_log is None  # not a speculative verify, which keeps its own rule
        if not invariant and T == 1 and self.in_place and plain:  # the state step runs the gated norm too
            step = ConvStep(conv, self.conv_weight, ctx.slot_ids, conv_into)
            y, z, b, a = self.kernels.linear(h, self.in_proj, norm=norm, conv=step).split(self.splits, dim=-1)
            o = self._step_in_place(y[:, 0], z[:, 0], b, a, rec, ctx.slot_ids, rec_into)
        else:
            qkv, z, b, a = self.kernels.linear(h, self.in_proj, norm=norm).split(self.splits, dim=-1)
            token_by_token = invariant or (plain and T <= self.in_place_tokens)
            if token_by_token:  # in place, token by token: never asked for a step launched ahead (launches_ahead)
                if ctx.states_aside:
                    raise ValueError("Gated DeltaNet stores states aside only from a one-token step or a gathered one")
                o = self._run_invariant(qkv, b, a, conv, rec, ctx)
            else:
                o = self._run_gathered(qkv, b, a, conv, rec, ctx, conv_into, rec_into)
            o = self.kernels.gated_rms_norm(o, z.reshape(B, T, self.hv, self.dv), self.norm, self.cfg.rms_norm_eps)
        return self.kernels.project_out(o.reshape(B, T, self.hv * self.dv), self.out, h)

    def _run_gathered(self, qkv_in, b, a, conv, rec, ctx: ForwardContext, conv_into=None, rec_into=None):
        """Any number of tokens: gather the slots' states, run conv and delta rule on the copies, scatter back (or
        store them `into` rows aside). Returns [B, T, Hv, dv]."""
        B, T, _ = qkv_in.shape
        conv0, rec0 = conv[ctx.slot_ids], rec[ctx.slot_ids]  # gathered copies: the states before this forward
        lengths = ctx.lengths if T > 1 and ctx.padded else None  # every token real: no padding masks
        conv_out, conv_rows = conv_into or (conv, ctx.slot_ids)
        rec_out, rec_rows = rec_into or (rec, ctx.slot_ids)
        qkv, conv_out[conv_rows] = causal_conv1d(qkv_in, conv0, self.conv_weight, lengths)
        q, k, v = qkv.split([self.hk * self.dk, self.hk * self.dk, self.hv * self.dv], dim=-1)
        group = self.hv // self.hk  # value head j reads key head j // group
        q = q.reshape(B, T, self.hk, self.dk).repeat_interleave(group, dim=2)
        k = k.reshape(B, T, self.hk, self.dk).repeat_interleave(group, dim=2)
        v = v.reshape(B, T, self.hv, self.dv)
        g, beta = self.kernels.decay_and_beta(a, b, self.neg_A, self.dt_bias)
        rule = gated_delta_rule if ctx.delta_rule is None else ctx.delta_rule  # verify may keep every state
        if ctx.checkpoints:
            o, rec_out[rec_rows] = self._with_checkpoints(
                rule, (q, k, v, g, beta), rec0, lengths, ctx, conv_inputs(conv0, qkv_in), conv.dtype
            )
        else:
            o, rec_out[rec_rows] = rule(q, k, v, g, beta, rec0, lengths)
        if ctx.gdn_log is not None:  # speculative verify: what rolling back to an accepted prefix needs
            ctx.gdn_log[self.layer] = (qkv_in, conv0, (q, k, v, g, beta, rec0))
        return o

    def _step_in_place(self, y, z, b, a, rec, slot_ids, into=None) -> torch.Tensor:
        """One token per row, y its conv's output, z its gate: [B, Hv, dv] outputs after the gated norm, each slot's
        state advanced where it lives (or stored `into` rows aside)."""
        q, k, v = y.split([self.hk * self.dk, self.hk * self.dk, self.hv * self.dv], dim=-1)
        B = y.shape[0]
        return recurrent_step(
            q.view(B, self.hk, self.dk),
            k.view(B, self.hk, self.dk),
            v.view(B, self.hv, self.dv),
            a[:, 0],
            b[:, 0],
            rec,
            slot_ids,
            L2_EPS,
            gates=(self.neg_A, self.dt_bias),  # the decay and beta computed in the step's kernel
            gated_norm=(z, self.norm, self.cfg.rms_norm_eps),
            prefetch=self.out,  # out_proj reads it next
            into=into,
        )

    def _run_invariant(self, qkv_in, b, a, conv, rec, ctx: ForwardContext) -> torch.Tensor:
        """Every token through the in-place kernels, whose per-token arithmetic is the same for one token or many:
        a token's output and state are bitwise equal decoded alone, verified, or prefilled whole or in chunks
        (the chunked delta rule would sum in another order). The rule runs in segments ending at the checkpoint
        offsets, handing back the state there. Returns [B, T, Hv, dv]."""
        B, T, _ = qkv_in.shape
        conv0 = conv[ctx.slot_ids] if ctx.checkpoints or ctx.gdn_log is not None else None  # a gathered copy
        y = conv_steps(qkv_in, conv, self.conv_weight, ctx.slot_ids, ctx.lengths)
        q, k, v = y.split([self.hk * self.dk, self.hk * self.dk, self.hv * self.dv], dim=-1)
        q, k = q.view(B, T, self.hk, self.dk), k.view(B, T, self.hk, self.dk)
        v = v.view(B, T, self.hv, self.dv)
        g, beta = self.kernels.decay_and_beta(a, b, self.neg_A, self.dt_bias)
        history = None
        if ctx.state_history is not None:
            history = torch.empty(B, T, self.hv, self.dk, self.dv, dtype=torch.float32, device=y.device)
            ctx.state_history.append(history)
        if ctx.gdn_log is not None:  # speculative verify: the conv window of any accepted prefix
            ctx.gdn_log[self.layer] = (qkv_in, conv0, None)
        outs, full = [], conv_inputs(cast(torch.Tensor, conv0), qkv_in) if ctx.checkpoints else None
        for lo, hi in pairwise([0, *checkpoint_ends(ctx, T)]):
            seg = (ctx.lengths - lo).clamp(0, hi - lo)  # rows that ended stay unchanged
            part = None if history is None else history[:, lo:hi]
            args = (x[:, lo:hi] for x in (q, k, v, g, beta))
            outs.append(
                recurrent_steps(*args, rec, ctx.slot_ids, seg, L2_EPS, part)  # type: ignore[call-arg]  # *args holds 5
            )
            for row, t in (c for c in ctx.checkpoints if c[1] == hi):
                self._keep_checkpoint(ctx, row, t, full, T, conv.dtype, rec[ctx.slot_ids[row]])
        return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]

    def _with_checkpoints(
        self,
        rule,
        inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        state,
        lengths,
        ctx: ForwardContext,
        full: torch.Tensor,
        conv_dtype: torch.dtype,
    ):
        """The delta rule in segments ending at each requested offset, handing back the state there (prefix-cache
        checkpoints without cutting the forward) in ctx.checkpoint_states. full: gated_delta.conv_inputs of this
        forward."""
        T = inputs[0].shape[1]
        ends = checkpoint_ends(ctx, T)
        o, ended = gated_delta_rule_segments(*inputs, state, lengths, ends, rule)
        states = dict(zip(ends, ended, strict=True))
        for row, t in ctx.checkpoints:
            self._keep_checkpoint(ctx, row, t, full, T, conv_dtype, states[t][row])
        return o, ended[-1]

    def _keep_checkpoint(self, ctx: ForwardContext, row: int, t: int, full, T: int, conv_dtype, state) -> None:
        """Copy row's conv window and recurrent state after its first t tokens into ctx.checkpoint_states.
        full: gated_delta.conv_inputs of this forward ([carried window | T inputs] per row)."""
        dst = ctx.checkpoint_states[(row, t)]
        dst[("conv", self.layer)] = full[row, :, t : t + full.shape[-1] - T].to(conv_dtype, copy=True)
        dst[("rec", self.layer)] = state.clone()


def checkpoint_ends(ctx: ForwardContext, T: int) -> list[int]:
    """Where a forward's T tokens are cut: every requested checkpoint offset, ascending, then T."""
    return [*sorted({t for _, t in ctx.checkpoints}), T]


class HybridModel(DecoderModel):
    norm_offset = True  # Qwen3.5 norms scale by (1 + w)

    def __init__(self, cfg: ModelConfig, w: dict, opts):
        pow2 = all(n & (n - 1) == 0 for n in (cfg.linear_key_head_dim, cfg.linear_value_head_dim))
        if opts.batch_invariant and not pow2:
            raise ValueError(
                "batch_invariant needs power-of-two Gated DeltaNet head dims (its in-place kernels), got "
                f"linear_key_head_dim={cfg.linear_key_head_dim}, linear_value_head_dim={cfg.linear_value_head_dim}"
            )
        self.in_place = pow2 and (
            opts.batch_invariant
            or opts.linear_decode == "triton"
            or (opts.linear_decode == "auto" and triton_available(opts.device))
        )
        self.in_place_tokens = opts.linear_in_place_tokens
        super().__init__(cfg, w, opts)
        backend_name(opts.device)  # imports fla now (seconds), while loading, rather than in the first request
        self.mtp = None  # the MTP draft head, built only when speculative decoding is on
        if cfg.mtp_num_hidden_layers and opts.speculative_tokens:
            from .mtp import MTPHead

            self.mtp = MTPHead(cfg, w, self)
        for name in [n for n in w if n.startswith("mtp.")]:
            w.pop(name)

    def make_mixer(self, w: dict, p: str, i: int):
        if self.cfg.layer_types[i] == "full_attention":
            return Attention(self.cfg, w, p + "self_attn.", i, self.kernels, gated=True)
        return GatedDeltaNet(self.cfg, w, p + "linear_attn.", i, self.kernels, self.in_place, self.in_place_tokens)
