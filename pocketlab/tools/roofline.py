"""What a step costs at best: the device's ceilings (copy bandwidth, matmul rate), measured in the same run, and
the bytes and flops a model shape implies (never the implementation)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..cache import linear_state_bytes
from ..config import ModelConfig
from ..loader import expected_shapes
from .timing import Clock


@torch.inference_mode()
def copy_bandwidth(clock: Clock, device: str, mib: int, repeats: int) -> dict:
    """Device-to-device copy. bytes_per_s counts bytes read + bytes written, i.e. every byte moved."""
    n = mib * 2**20
    src = torch.ones(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = clock.measure(lambda: dst.copy_(src), repeats=max(repeats, 10), warmup=3)
    return {"buffer_bytes": n, "seconds": seconds, "bytes_per_s": 2 * n / seconds}


@torch.inference_mode()
def matmul_rate(clock: Clock, device: str, dtype: torch.dtype, n: int, repeats: int) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    c = torch.empty_like(a)
    seconds = clock.measure(lambda: torch.mm(a, b, out=c), repeats=max(repeats, 10), warmup=3)
    return {"n": n, "seconds": seconds, "flop_per_s": 2 * n**3 / seconds}


@dataclass
class ModelCost:
    """Bytes and flops implied by the model shape (never by the implementation)."""

    layer_matmul_params: int  # 2-D weights inside the decoder layers, plus the top-k routed experts a token runs
    head_params: int  # lm_head (vocab x hidden)
    weight_bytes: int  # read once per decode step: all weights except the embedding table and the routed experts
    kv_bytes_per_token: int  # K + V of one position over all full-attention layers
    state_bytes_per_seq: int  # recurrent + conv state of one sequence over all linear layers
    attn_flops_per_pair: int  # one (query, key) pair over all full-attention layers: QK^T + PV
    linear_flops_per_token: int  # Gated DeltaNet state update + readout over all linear layers
    expert_bytes: int = 0  # one routed expert of one layer (gate, up, down): read once per step if any token picks it
    moe_layers: int = 0
    num_experts: int = 0
    top_k: int = 0

    @classmethod
    def of(cls, cfg: ModelConfig, elem_bytes: int) -> ModelCost:
        shapes = {n: s for n, s in expected_shapes(cfg).items() if not n.startswith("mtp.")}
        moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
        expert_params = 3 * cfg.moe_intermediate_size * cfg.hidden_size
        layer_matmul = sum(math.prod(s) for n, s in shapes.items() if n.startswith("model.layers.") and len(s) == 2)
        layer_matmul += moe_layers * cfg.num_experts_per_tok * expert_params
        head = cfg.vocab_size * cfg.hidden_size
        # The embedding table is only gathered (B rows per step); a tied table is read in full as the lm_head.
        # Routed experts are counted per step by how many the step's tokens pick (decode_bytes).
        skip = ("model.embed_tokens.weight",)
        weight_elems = sum(math.prod(s) for n, s in shapes.items() if n not in skip and ".mlp.experts." not in n)
        weight_elems += head if cfg.tie_word_embeddings else 0
        n_attn, n_lin = len(cfg.attention_layers), len(cfg.linear_layers)
        hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        return cls(
            layer_matmul_params=layer_matmul,
            head_params=head,
            weight_bytes=weight_elems * elem_bytes,
            kv_bytes_per_token=n_attn * 2 * cfg.num_key_value_heads * cfg.head_dim * elem_bytes,
            state_bytes_per_seq=linear_state_bytes(cfg, elem_bytes),
            attn_flops_per_pair=n_attn * 4 * cfg.num_attention_heads * cfg.head_dim,
            # per token and value head: decay, S^T k, k (x) delta, S^T q ~ three dk x dv products (6 flops/elem)
            linear_flops_per_token=n_lin * 6 * hv * dk * dv,
            expert_bytes=expert_params * elem_bytes,
            moe_layers=moe_layers,
            num_experts=cfg.num_experts if moe_layers else 0,
            top_k=cfg.num_experts_per_tok if moe_layers else 0,
        )

    def expected_experts(self, batch: int) -> float:
        """(layer, expert) pairs a decode step of `batch` tokens reads if routing were uniform: per MoE layer
        E * (1 - (1 - k/E)^B) distinct experts."""
        if not self.moe_layers:
            return 0.0
        E, k = self.num_experts, self.top_k
        return self.moe_layers * E * (1 - (1 - k / E) ** batch)

    def prefill_flops(self, length: int) -> int:
        """Useful flops of prefilling one sequence from empty: causal pairs only, logits for the last token."""
        return (
            2 * self.layer_matmul_params * length
            + 2 * self.head_params
            + self.attn_flops_per_pair * length * (length + 1) // 2
            + self.linear_flops_per_token * length
        )

    def decode_bytes(self, kv_lens: list[float], experts_read: float | None = None) -> dict:
        """Minimum bytes one decode step moves, for sequences attending over `kv_lens` positions.

        Weights and K/V are read once; the recurrent state is read AND written (it is rewritten each step).
        MoE: each routed expert some token picks is read once; `experts_read` counts those (layer, expert) pairs
        (measured: the bench counts the step's routing), by default the uniform-routing expectation.
        """
        kv = self.kv_bytes_per_token * sum(kv_lens)
        state = 2 * self.state_bytes_per_seq * len(kv_lens)
        if experts_read is None:
            experts_read = self.expected_experts(len(kv_lens))
        experts = int(round(experts_read * self.expert_bytes))
        return {
            "weight_bytes": self.weight_bytes,
            "expert_bytes": experts,
            "experts_read": experts_read,
            "kv_bytes": kv,
            "state_bytes": state,
            "total_bytes": self.weight_bytes + experts + kv + state,
        }
