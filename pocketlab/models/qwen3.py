"""Qwen2 / Qwen3 (and Qwen3-MoE) decoder: pre-norm attention + SwiGLU MLP or MoE blocks over the slot cache."""

from __future__ import annotations

import torch

from ..cache import SlotCache
from ..config import ModelConfig
from ..forward import AttentionPath, ForwardContext
from ..layers.attention import cached_attention, write_kv
from ..layers.decode_attention import available as decode_attention_available
from ..layers.decode_attention import decode_attention
from ..layers.kernels import Kernels, kernels_for
from ..layers.moe import SparseMoE
from ..layers.norm import RMSNorm
from ..layers.rotary import Rotary, norm_and_rotate


class MLP:
    def __init__(self, w: dict, p: str, kernels: Kernels):
        # gate and up fused into one matmul: one weight read per step instead of two launches
        self.gate_up = torch.cat([w.pop(p + "gate_proj.weight"), w.pop(p + "up_proj.weight")])
        self.down = w.pop(p + "down_proj.weight")
        self.kernels = kernels

    def __call__(self, h, x, then):
        """h + down(silu(gate(x)) * up(x)) and `then` of it: two kernels where the linear fuses."""
        return self.kernels.project_out(self.kernels.linear(x, self.gate_up, swiglu=True), self.down, h, then)


class Attention:
    """Full attention; `gated` is Qwen3.5's variant (q_proj also emits a sigmoid output gate, (1+w) norms).
    kv_key: where this layer's K/V live in the SlotCache (the layer index, or a name such as the MTP head's)."""

    def __init__(self, cfg: ModelConfig, w: dict, p: str, kv_key: int | str, kernels: Kernels, gated: bool = False):
        self.cfg, self.kv_key, self.gated, self.kernels = cfg, kv_key, gated, kernels
        self.nq, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size = self.nq * self.hd * (2 if gated else 1)
        names = ("q_proj", "k_proj", "v_proj")
        self.qkv = torch.cat([w.pop(f"{p}{n}.weight") for n in names])
        self.qkv_bias = torch.cat([w.pop(f"{p}{n}.bias") for n in names]) if cfg.attention_bias else None
        self.o = w.pop(p + "o_proj.weight")
        self.q_norm = w.pop(p + "q_norm.weight", None)
        self.k_norm = w.pop(p + "k_norm.weight", None)

    def __call__(self, h, x, then, ctx: ForwardContext, cache: SlotCache):
        """h + attention(x) and `then` of it, the residual add (and `then`) inside o_proj's kernel where it fuses."""
        B, T, _ = h.shape
        q, k, v = self.kernels.linear(x, self.qkv, self.qkv_bias).split(
            [self.q_size, self.nkv * self.hd, self.nkv * self.hd], dim=-1
        )
        if self.gated:  # per head: [q_h | gate_h]
            q, gate = q.view(B, T, self.nq, 2 * self.hd).chunk(2, dim=-1)
            gate = gate.reshape(B, T, self.nq * self.hd)
        q, k, v = q.reshape(B, T, self.nq, self.hd), k.view(B, T, self.nkv, self.hd), v.view(B, T, self.nkv, self.hd)
        k_cache, v_cache, eps = cache.k[self.kv_key], cache.v[self.kv_key], self.cfg.rms_norm_eps
        norms = (self.q_norm, self.k_norm, eps, self.gated) if self.q_norm is not None else None
        if ctx.attention is AttentionPath.DECODE_KERNEL:  # one kernel norms, rotates, stores K/V and attends
            rope = tuple(t[:, 0, 0] for t in ctx.rope)
            out = decode_attention(
                q[:, 0],
                k[:, 0],
                v[:, 0],
                k_cache,
                v_cache,
                ctx.slot_ids,
                ctx.kv_lengths,
                ctx.kv_len,
                self.hd**-0.5,
                rope,
                norms,
            )[:, None]
        elif ctx.attention is AttentionPath.INVARIANT:  # one row kernel norms, rotates and stores; then attend
            q = self.kernels.norm_rotate_store(q, k, v, k_cache, v_cache, ctx.kv_targets, ctx.rope, norms)
            out = self.kernels.attention(
                q, k_cache, v_cache, ctx.slot_ids, ctx.start, ctx.lengths, self.hd**-0.5, ctx.kv_len
            )
        else:
            q, k = norm_and_rotate(q, k, self.q_norm, self.k_norm, *ctx.rope, eps, self.gated)
            write_kv(k_cache, v_cache, k, v, ctx.kv_targets)
            out = cached_attention(q, k_cache, v_cache, ctx, self.hd**-0.5)
        out = out.reshape(B, T, self.nq * self.hd)
        if self.gated:
            out = self.kernels.sigmoid_gate(out, gate)
        return self.kernels.project_out(out, self.o, h, then)


def make_mlp(cfg: ModelConfig, w: dict, p: str, kernels: Kernels, moe: bool):
    """The feed-forward part of a block at prefix p ("...mlp."): a sparse MoE block or the dense SwiGLU MLP."""
    return SparseMoE(cfg, w, p, kernels) if moe else MLP(w, p, kernels)


class DecoderLayer:
    """One pre-norm decoder block: a token mixer (Attention, or Qwen3.5's GatedDeltaNet) then an MLP (dense, or a
    mixture of experts), each reading the normed residual stream and adding to it."""

    def __init__(self, w: dict, p: str, mixer, mlp, eps: float, offset: bool, kernels: Kernels):
        self.input_norm = RMSNorm(w.pop(p + "input_layernorm.weight"), eps, offset, kernels)
        self.mixer = mixer
        self.post_norm = RMSNorm(w.pop(p + "post_attention_layernorm.weight"), eps, offset, kernels)
        self.mlp = mlp

    def __call__(self, h, x, then, ctx: ForwardContext, cache: SlotCache):
        """(h, x = input_norm(h)) -> (h', then(h')): each projection into the residual stream also norms it for
        whoever reads it next (in one kernel where the linear fuses), so no norm runs on its own."""
        h, x = self.mixer(h, x, self.post_norm, ctx, cache)  # h + mixer(x), and post_norm of that
        return self.mlp(h, x, then)  # h + mlp(x), and the next block's input norm (or the final norm) of that


class DecoderModel:
    """Shared skeleton: embed -> blocks -> final norm. Subclasses choose each layer's mixer."""

    norm_offset = False

    def __init__(self, cfg: ModelConfig, w: dict, opts):
        self.cfg, self.kernels = cfg, kernels_for(opts)
        eps = cfg.rms_norm_eps
        self.embed = w.pop("model.embed_tokens.weight")
        self.lm_head = self.embed if cfg.tie_word_embeddings else w.pop("lm_head.weight")
        self.final_norm = RMSNorm(w.pop("model.norm.weight"), eps, self.norm_offset, self.kernels)
        self.decode_kernel = opts.decode_attention == "triton" or (
            opts.decode_attention == "auto" and decode_attention_available(opts.device)
        )
        self.rotary = Rotary(cfg.rotary_dim, cfg.rope_theta, opts.max_seq_len, opts.device, opts.torch_dtype, cfg.yarn)
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            mlp = make_mlp(cfg, w, p + "mlp.", self.kernels, cfg.is_moe_layer(i))
            self.layers.append(DecoderLayer(w, p, self.make_mixer(w, p, i), mlp, eps, self.norm_offset, self.kernels))
        self.norms_after = [layer.input_norm for layer in self.layers[1:]] + [self.final_norm]  # layer i's `then`

    def make_mixer(self, w: dict, p: str, i: int):
        return Attention(self.cfg, w, p + "self_attn.", i, self.kernels)

    def forward(self, ctx: ForwardContext, cache: SlotCache) -> torch.Tensor:
        """Final-normed hidden states [B, T, hidden] for every token of the context's runs."""
        self.prepare(ctx)
        h = self.kernels.embedding(ctx.tokens, self.embed)
        x = self.layers[0].input_norm(h)
        for layer, then in zip(self.layers, self.norms_after, strict=True):
            h, x = layer(h, x, then, ctx, cache)
        return x

    def prepare(self, ctx: ForwardContext) -> None:
        ctx.prepare(self.rotary, self.decode_kernel, invariant=self.kernels.attention is not None)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.kernels.gather_vocab(self.kernels.linear(hidden, self.lm_head)).float()


class DenseModel(DecoderModel):
    """Qwen2 (qkv bias, no q/k norm) and Qwen3 (q/k RMSNorm per head before RoPE); Qwen3-MoE is Qwen3 with sparse
    MoE blocks where transformers puts them."""
