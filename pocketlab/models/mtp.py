"""Qwen3.5's multi-token-prediction (MTP) head: a one-layer draft model riding on the main model.

For a sequence x_0 .. x_n with main-model final-normed hidden states h_t, the head's row t is

    u_t = fc( cat( norm_e(embed(x_{t+1})), norm_h(h_t) ) )          fc: [hidden, 2*hidden], no bias
    o_t = norm( block(u_t) )                                         block: one gated full-attention decoder layer
    logits_t = lm_head(o_t)  ~  a guess for x_{t+2}

with the embedding and lm_head shared with the main model and every norm in Qwen3.5's (1 + w) form.
The block is exactly a main-model full-attention layer (DecoderLayer: Attention(gated=True) + MLP, or for
Qwen3.5-MoE the sparse MoE block with its shared expert: mtp.layers.0.mlp.experts.{e}.*, as vLLM loads it), own KV
per slot, stored in SlotCache.k/v under the key "mtp" so snapshots and copies carry it.

Position convention: row t (the pair h_t, x_{t+1}) is written to MTP KV index t and rotated at position t,
the position of the hidden state it reads (vLLM's convention for this head). Rotating at t + 1 (the
position of the token it embeds) instead gives the same logits up to rounding: RoPE scores depend only on
the distance between query and key, and every row moves by the same 1 (tests/test_mtp.py checks both).

Drafting k tokens applies the head recursively: row n-1 (h_{n-1}, x_n) gives d_1; row n then pairs the
head's own output o_{n-1} (in place of the main model's h_n, not known yet) with d_1, and so on. Those
recursive rows are provisional: after verification the accepted rows are recomputed from the main
model's real hidden states (see pocketlab.speculative.MTPDrafter).
"""

from __future__ import annotations

import torch

from ..cache import SlotCache
from ..config import ModelConfig
from ..forward import ForwardContext
from ..layers.norm import RMSNorm
from .qwen3 import Attention, DecoderLayer, make_mlp

KV_KEY = "mtp"


class MTPHead:
    def __init__(self, cfg: ModelConfig, w: dict, main):
        if cfg.mtp_num_hidden_layers != 1:
            raise ValueError(
                f"mtp_num_hidden_layers={cfg.mtp_num_hidden_layers}: pocketlab drafts with one MTP "
                "layer (Qwen3.5 checkpoints carry exactly one)"
            )
        if cfg.mtp_use_dedicated_embeddings:
            raise ValueError("mtp_use_dedicated_embeddings=true: pocketlab's MTP head shares the main embedding")
        self.cfg, self.main = cfg, main
        eps = cfg.rms_norm_eps
        self.fc = w.pop("mtp.fc.weight")
        self.norm_embed = w.pop("mtp.pre_fc_norm_embedding.weight")
        self.norm_hidden = w.pop("mtp.pre_fc_norm_hidden.weight")
        p = "mtp.layers.0."
        kernels = main.kernels
        attention = Attention(cfg, w, p + "self_attn.", KV_KEY, kernels, gated=True)
        mlp = make_mlp(cfg, w, p + "mlp.", kernels, cfg.is_moe_layer(None))  # Qwen3.5-MoE: an MoE block
        self.layer = DecoderLayer(w, p, attention, mlp, eps, True, kernels)
        self.norm = RMSNorm(w.pop("mtp.norm.weight"), eps, True, kernels)

    def register(self, cache: SlotCache) -> None:
        """Give every slot a KV region for the MTP layer."""
        if KV_KEY not in cache.k:
            cache.add_kv(KV_KEY, self.cfg.num_key_value_heads, self.cfg.head_dim)

    def forward(self, ctx: ForwardContext, hidden: torch.Tensor, cache: SlotCache) -> torch.Tensor:
        """Rows (h_t, x_{t+1}): ctx.tokens[b, j] = x_{t+1}, hidden[b, j] = h_t, t = ctx.start[b] + j.

        Writes the MTP KV at index t for each row and returns the normed outputs o_t [B, T, hidden]
        (feed them to `logits`, or back in as the hidden state of the next recursive row)."""
        eps, kernels = self.cfg.rms_norm_eps, self.main.kernels
        e = kernels.rms_norm(kernels.embedding(ctx.tokens, self.main.embed), self.norm_embed, eps, True)
        h = kernels.rms_norm(hidden.to(e.dtype), self.norm_hidden, eps, True)
        x = kernels.linear(torch.cat([e, h], dim=-1), self.fc)
        self.main.prepare(ctx)
        return self.norm(self.layer(x, ctx, cache))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.main.logits(out)
