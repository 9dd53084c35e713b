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
    syncs_with_host = False

    def __init__(self, w: dict, p: str, kernels: Kernels):
        # gate and up fused into one matmul: one weight read per step instead of two launches
        self.gate_up = torch.cat([w.pop(p + "gate_proj.weight"), w.pop(p + "up_proj.weight")])
        self.down = w.pop(p + "down_proj.weight")
        self.kernels = kernels

    @property
    def normed_weight(self) -> torch.Tensor:
        """The weight of the projection that reads the pre-norm's output (DecoderLayer folds the norm into it)."""
        return self.gate_up

    def __call__(self, h, norm):
        """h + down(silu(gate(x)) * up(x)) with x = norm(h): two kernels where the linears fuse the norm and the add."""
        return self.kernels.project_out(self.kernels.linear(h, self.gate_up, swiglu=True, norm=norm), self.down, h)


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

    @property
    def normed_weight(self) -> torch.Tensor:
        return self.qkv

    def __call__(self, h, norm, ctx: ForwardContext, cache: SlotCache):
        """h + attention(norm(h)), the norm inside qkv's kernel and the residual add inside o_proj's where they fuse."""
        B, T, _ = h.shape
        q, k, v = self.kernels.linear(h, self.qkv, self.qkv_bias, norm=norm).split(
            [self.q_size, self.nkv * self.hd, self.nkv * self.hd], dim=-1
        )
        if self.gated:  # per head: [q_h | gate_h]; the gate stays a view, [B, T, heads, head_dim] as `out` below
            q, gate = q.view(B, T, self.nq, 2 * self.hd).chunk(2, dim=-1)
        q, k, v = q.reshape(B, T, self.nq, self.hd), k.view(B, T, self.nkv, self.hd), v.view(B, T, self.nkv, self.hd)
        k_cache, v_cache, eps = cache.k[self.kv_key], cache.v[self.kv_key], self.cfg.rms_norm_eps
        norms = (self.q_norm, self.k_norm, eps, self.gated) if self.q_norm is not None else None
        in_one_kernel = ctx.attention is AttentionPath.DECODE_KERNEL
        if in_one_kernel:  # one kernel norms, rotates, stores K/V, attends (and gates)
            assert ctx.kv_lengths is not None and ctx.rotary is not None and ctx.positions is not None  # prepare's
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
                (ctx.rotary.cos, ctx.rotary.sin),
                norms,
                gate[:, 0] if self.gated else None,
                prefetch=self.o,  # o_proj reads it next
                positions=ctx.positions[:, 0],
            )[:, None]
        else:
            assert ctx.kv_targets is not None and ctx.rope is not None  # prepare set them for every other path
            if self.kernels.norm_rotate_store is not None:  # one row kernel norms, rotates and stores
                q = self.kernels.norm_rotate_store(q, k, v, k_cache, v_cache, ctx.kv_targets, ctx.rope, norms)
            else:  # torch's chain of a dozen kernels
                q, k = norm_and_rotate(q, k, self.q_norm, self.k_norm, *ctx.rope, eps, self.gated)
                write_kv(k_cache, v_cache, k, v, ctx.kv_targets)
            if ctx.attention is AttentionPath.INVARIANT:
                assert self.kernels.attention is not None  # INVARIANT: the model's kernels have one
                out = self.kernels.attention(
                    q, k_cache, v_cache, ctx.slot_ids, ctx.start, ctx.lengths, self.hd**-0.5, ctx.kv_len
                )
            else:
                out = cached_attention(q, k_cache, v_cache, ctx, self.hd**-0.5)
        if self.gated and not in_one_kernel:
            out = self.kernels.sigmoid_gate(out, gate)
        return self.kernels.project_out(out.reshape(B, T, self.nq * self.hd), self.o, h)


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
        for norm, reads_it in ((self.input_norm, mixer), (self.post_norm, mlp)):  # the launches then norm a row
            weight = getattr(reads_it, "normed_weight", None)  # a MoE block norms in its own kernels
            if weight is not None and kernels.folds_norm(weight, swiglu=reads_it is mlp):
                norm.fold_into(weight)

    def __call__(self, h, ctx: ForwardContext, cache: SlotCache):
        """h -> h + mixer(input_norm(h)) -> h + mlp(post_norm(h)). Each norm is handed to the projection that reads
        it, which norms its rows in its own launch where it can (layers.gemv), so no norm runs on its own there."""
        h = self.mixer(h, self.input_norm, ctx, cache)
        return self.mlp(h, self.post_norm)


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

    @property
    def syncs_with_host(self) -> bool:
        """Whether a forward reads device values on the host (then no CUDA graph can hold it)."""
        return any(layer.mlp.syncs_with_host for layer in self.layers)

    def make_mixer(self, w: dict, p: str, i: int):
        return Attention(self.cfg, w, p + "self_attn.", i, self.kernels)

    def forward(self, ctx: ForwardContext, cache: SlotCache) -> torch.Tensor:
        """Final-normed hidden states [B, T, hidden] for every token of the context's runs."""
        self.prepare(ctx)
        h = self.kernels.embedding(ctx.tokens, self.embed)
        for layer in self.layers:
            h = layer(h, ctx, cache)
        return self.final_norm(h)

    def prepare(self, ctx: ForwardContext) -> None:
        ctx.prepare(self.rotary, self.decode_kernel, invariant=self.kernels.attention is not None)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._vocab_logits(hidden).float()

    def logits_and_argmax(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 logits, their argmax per row): a decode graph's outputs, one launch after the lm_head's."""
        return self.kernels.logits_and_argmax(self._vocab_logits(hidden))

    def _vocab_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.kernels.gather_vocab(self.kernels.linear(hidden, self.lm_head))


class DenseModel(DecoderModel):
    """Qwen2 (qkv bias, no q/k norm) and Qwen3 (q/k RMSNorm per head before RoPE); Qwen3-MoE is Qwen3 with sparse
    MoE blocks where transformers puts them."""
