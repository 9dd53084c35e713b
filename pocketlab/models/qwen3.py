"""Qwen2 / Qwen3 decoder: pre-norm attention + SwiGLU MLP blocks over the slot cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..batch import ForwardBatch
from ..cache import SlotCache
from ..config import ModelConfig
from ..layers.attention import cached_attention, write_kv
from ..layers.decode_attention import available as decode_attention_available
from ..layers.decode_attention import decode_attention
from ..layers.fused import cuda_compiled
from ..layers.norm import add_rms_norm, rms_norm
from ..layers.rotary import Rotary, norm_and_rotate


class MLP:
    def __init__(self, w: dict, p: str):
        # gate and up fused into one matmul: one weight read per step instead of two launches
        self.gate_up = torch.cat([w.pop(p + "gate_proj.weight"), w.pop(p + "up_proj.weight")])
        self.down = w.pop(p + "down_proj.weight")

    def __call__(self, x):
        return F.linear(swiglu(F.linear(x, self.gate_up)), self.down)


@cuda_compiled
def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class Attention:
    """Full attention; `gated` is Qwen3.5's variant (q_proj also emits a sigmoid output gate, (1+w) norms)."""

    def __init__(self, cfg: ModelConfig, w: dict, p: str, layer: int, gated: bool = False):
        self.cfg, self.layer, self.gated = cfg, layer, gated
        self.nq, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size = self.nq * self.hd * (2 if gated else 1)
        names = ("q_proj", "k_proj", "v_proj")
        self.qkv = torch.cat([w.pop(f"{p}{n}.weight") for n in names])
        self.qkv_bias = torch.cat([w.pop(f"{p}{n}.bias") for n in names]) if cfg.attention_bias else None
        self.o = w.pop(p + "o_proj.weight")
        self.q_norm = w.pop(p + "q_norm.weight", None)
        self.k_norm = w.pop(p + "k_norm.weight", None)

    def __call__(self, x, batch: ForwardBatch, cache: SlotCache, ctx: dict):
        B, T, _ = x.shape
        q, k, v = F.linear(x, self.qkv, self.qkv_bias).split(
            [self.q_size, self.nkv * self.hd, self.nkv * self.hd], dim=-1
        )
        if self.gated:  # per head: [q_h | gate_h]
            q, gate = q.view(B, T, self.nq, 2 * self.hd).chunk(2, dim=-1)
            gate = gate.reshape(B, T, self.nq * self.hd)
        q, k, v = q.reshape(B, T, self.nq, self.hd), k.view(B, T, self.nkv, self.hd), v.view(B, T, self.nkv, self.hd)
        k_cache, v_cache, eps = cache.k[self.layer], cache.v[self.layer], self.cfg.rms_norm_eps
        if ctx["mask"] is None:  # one token per row on CUDA: one kernel norms, rotates, stores K/V and attends
            norms = (self.q_norm, self.k_norm, eps, self.gated) if self.q_norm is not None else None
            rope = tuple(t[:, 0, 0] for t in ctx["rope"])
            out = decode_attention(
                q[:, 0],
                k[:, 0],
                v[:, 0],
                k_cache,
                v_cache,
                batch.slot_ids,
                ctx["lengths"],
                batch.kv_len,
                self.hd**-0.5,
                rope,
                norms,
            )[:, None]
        else:
            q, k = norm_and_rotate(q, k, self.q_norm, self.k_norm, *ctx["rope"], eps, self.gated)
            write_kv(k_cache, v_cache, k, v, batch, ctx["targets"])
            out = cached_attention(q, k_cache, v_cache, batch, ctx["mask"], self.hd**-0.5)
        out = out.reshape(B, T, self.nq * self.hd)
        if self.gated:
            out = out * torch.sigmoid(gate)
        return F.linear(out, self.o)


class DecoderModel:
    """Shared skeleton: embed -> blocks -> final norm. Subclasses choose each layer's mixer."""

    norm_offset = False

    def __init__(self, cfg: ModelConfig, w: dict, opts):
        self.cfg = cfg
        self.embed = w.pop("model.embed_tokens.weight")
        self.lm_head = self.embed if cfg.tie_word_embeddings else w.pop("lm_head.weight")
        self.final_norm = w.pop("model.norm.weight")
        self.decode_kernel = opts.decode_attention == "triton" or (
            opts.decode_attention == "auto" and decode_attention_available(opts.device)
        )
        self.rotary = Rotary(cfg.rotary_dim, cfg.rope_theta, opts.max_seq_len, opts.device, opts.torch_dtype)
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            self.layers.append(
                (
                    w.pop(p + "input_layernorm.weight"),
                    self.make_mixer(w, p, i),
                    w.pop(p + "post_attention_layernorm.weight"),
                    MLP(w, p + "mlp."),
                )
            )

    def make_mixer(self, w: dict, p: str, i: int):
        return Attention(self.cfg, w, p + "self_attn.", i)

    def context(self, batch: ForwardBatch) -> dict:
        """Per-forward tensors shared by all layers (computed once, not per layer)."""
        positions = batch.positions
        if batch.tokens.shape[1] == 1 and self.decode_kernel:  # the decode kernel writes K/V itself
            return {"rope": self.rotary.table(positions), "mask": None, "lengths": batch.start + 1}
        return {
            "rope": self.rotary.table(positions),
            "targets": batch.write_targets(positions),
            "mask": batch.attention_mask(positions),
        }

    def forward(self, batch: ForwardBatch, cache: SlotCache) -> torch.Tensor:
        """Final-normed hidden states [B, T, hidden] for every token of the batch."""
        eps, off = self.cfg.rms_norm_eps, self.norm_offset
        ctx = self.context(batch)
        x = F.embedding(batch.tokens, self.embed)
        h = rms_norm(x, self.layers[0][0], eps, off)
        next_norms = [layer[0] for layer in self.layers[1:]] + [self.final_norm]
        for (_, mixer, norm2, mlp), next_norm in zip(self.layers, next_norms):
            x, h = add_rms_norm(x, mixer(h, batch, cache, ctx), norm2, eps, off)
            x, h = add_rms_norm(x, mlp(h), next_norm, eps, off)
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head).float()


class DenseModel(DecoderModel):
    """Qwen2 (qkv bias, no q/k norm) and Qwen3 (q/k RMSNorm per head before RoPE)."""
