"""Model facts read from a Hugging Face config.json, and the engine's own options."""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

DENSE_TYPES = ("qwen2", "qwen3", "qwen3_moe")
HYBRID_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
MOE_TYPES = ("qwen3_moe", "qwen3_5_moe", "qwen3_5_moe_text")
# transformers' config defaults for keys a config.json may omit; Qwen3.5-MoE always renormalizes its top-k and runs
# every layer (the MTP one too) as a sparse block with a shared expert, whatever the file says
_MOE_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144, norm_topk_prob=False
    ),
    "qwen3_5_moe": dict(
        num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512
    ),
}
_MOE_FORCED: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(shared_expert_intermediate_size=0),
    "qwen3_5_moe": dict(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=(), intermediate_size=0),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_SPECULATIVE_TOKENS = 7
GEMV_MAX_ROWS = 4  # the rows of one layers.gemv launch: every projection of up to this many rows can take it
YARN_KEYS: tuple[str, ...]
YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "mscale")
YARN_KEYS += ("mscale_all_dim", "truncate")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    partial_rotary_factor: float = 1.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    layer_types: tuple[str, ...] = ()
    # Gated DeltaNet (hybrid models only)
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    mtp_num_hidden_layers: int = 0
    mtp_use_dedicated_embeddings: bool = False  # Qwen3.5 checkpoints: False (the head shares embed_tokens)
    rope_scaling: tuple[tuple[str, object], ...] = ()  # YaRN's parameters as sorted items; () for plain RoPE
    fp8_weight_block: tuple[int, ...] = ()  # block-FP8 checkpoint (rows, cols per scale): dequantized at load
    # mixture of experts (qwen3_moe, qwen3_5_moe): which layers are sparse follows HF (see is_moe_layer)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # Qwen3.5-MoE: one always-on expert behind a sigmoid gate
    norm_topk_prob: bool = False  # rescale the top-k routing probabilities to sum to 1
    decoder_sparse_step: int = 1  # every step-th layer is sparse...
    mlp_only_layers: tuple[int, ...] = ()  # ...except these, which keep a dense MLP of intermediate_size

    @property
    def yarn(self) -> dict | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @property
    def is_hybrid(self) -> bool:
        return self.model_type in HYBRID_TYPES

    @property
    def is_moe(self) -> bool:
        return self.model_type in MOE_TYPES

    def is_moe_layer(self, i: int | None) -> bool:
        """Whether decoder layer i (None: the MTP head's layer) is a sparse MoE block, decided as transformers
        decides it: Qwen3-MoE by mlp_only_layers and decoder_sparse_step, Qwen3.5-MoE always (its MTP layer too,
        as vLLM and SGLang build it)."""
        if not self.is_moe or self.num_experts <= 0:
            return False
        if i is None:
            return self.is_hybrid
        return i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def linear_conv_dim(self) -> int:
        """Channels of a Gated DeltaNet layer's conv: its q, k and v, as in_proj_qkv produces them."""
        return (
            2 * self.linear_num_key_heads * self.linear_key_head_dim
            + self.linear_num_value_heads * self.linear_value_head_dim
        )

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in DENSE_TYPES + HYBRID_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; pocketlab serves {DENSE_TYPES + HYBRID_TYPES}")
        text = dict(raw.get("text_config") or raw)  # qwen3_5 nests the language model under text_config
        text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
        # transformers v5 writes rope_parameters; older configs rope_theta + rope_scaling {"type": ...}
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        n_layers = text["num_hidden_layers"]
        hybrid = model_type in HYBRID_TYPES
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = text.get("full_attention_interval", 4)
            layer_types = [
                "linear_attention" if hybrid and (i + 1) % interval else "full_attention" for i in range(n_layers)
            ]
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in text.items() if k in known}
        if model_type in MOE_TYPES:
            values |= _moe_values(text, "qwen3_5_moe" if hybrid else "qwen3_moe")
        values.update(
            model_type=model_type,
            head_dim=text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"],
            rope_theta=rope.get("rope_theta", text.get("rope_theta", 1e6)),
            partial_rotary_factor=rope.get(
                "partial_rotary_factor", text.get("partial_rotary_factor", 0.25 if hybrid else 1.0)
            ),
            attention_bias=text.get("attention_bias", model_type == "qwen2"),
            layer_types=tuple(layer_types),
            rope_scaling=_rope_scaling(rope, text, model_type),
            fp8_weight_block=_fp8_block(raw.get("quantization_config") or text.get("quantization_config")),
        )
        return cls(**values)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        file = Path(path) / "config.json"
        if not file.is_file():
            raise ValueError(f"{path}: no config.json; expected a Hugging Face checkpoint folder")
        return cls.from_dict(json.loads(file.read_text()))


def generation_defaults(path: str | Path) -> dict:
    """SamplingParams fields from the checkpoint's generation_config.json (config.json's eos_token_id when it has
    none), read as transformers reads them: eos ids stop a request; do_sample false (its default) means greedy,
    true means temperature / top_p / top_k with transformers' defaults 1.0 / 1.0 / 50; repetition_penalty applies
    either way (Qwen2/2.5 instruct checkpoints ship 1.05). Files that give no valid SamplingParams are a ValueError
    here, at load, rather than at the first request."""
    from .sampling import SamplingParams

    path = Path(path)
    gen_file, cfg_file = path / "generation_config.json", path / "config.json"
    try:
        gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
        raw = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        eos = gen.get("eos_token_id", raw.get("eos_token_id", (raw.get("text_config") or {}).get("eos_token_id")))
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        out: dict = {"stop_token_ids": tuple(int(t) for t in eos)}
        if gen.get("do_sample"):
            out |= dict(
                temperature=float(gen.get("temperature", 1.0)),
                top_p=float(gen.get("top_p", 1.0)),
                top_k=int(gen.get("top_k", 50) or 0),
            )
        if gen.get("max_new_tokens"):
            out["max_new_tokens"] = int(gen["max_new_tokens"])
        if gen.get("repetition_penalty") not in (None, 1.0):  # a logits processor: applies with do_sample false too
            out["repetition_penalty"] = float(gen["repetition_penalty"])
        SamplingParams(**out)
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"{gen_file} (with config.json's eos_token_id): no valid sampling defaults: {e}") from e
    return out


def _moe_values(text: dict, family: str) -> dict:
    """The MoE fields with transformers' defaults (its config.json spells num_experts `num_local_experts`, the hub's
    `num_experts`); a top-k that cannot be routed is a ValueError."""
    out: dict[str, Any] = dict(_MOE_DEFAULTS[family])
    out |= {k: text[k] for k in out if text.get(k) is not None}
    if text.get("num_experts") is None and text.get("num_local_experts") is not None:
        out["num_experts"] = text["num_local_experts"]
    for key in ("decoder_sparse_step", "mlp_only_layers"):
        if text.get(key) is not None:
            out[key] = text[key]
    out |= _MOE_FORCED[family]
    out["mlp_only_layers"] = tuple(int(i) for i in out.get("mlp_only_layers", ()))
    e, k = int(out["num_experts"]), int(out["num_experts_per_tok"])
    if e > 0 and not 1 <= k <= e:
        raise ValueError(f"num_experts_per_tok={k} with num_experts={e}: a token is routed to 1..num_experts experts")
    if e > 0 and out["moe_intermediate_size"] < 1:
        raise ValueError(f"moe_intermediate_size={out['moe_intermediate_size']}: an MoE model needs experts >= 1 wide")
    if out.get("decoder_sparse_step", 1) < 1:
        raise ValueError(f"decoder_sparse_step={out['decoder_sparse_step']}: need >= 1")
    return out


def _rope_scaling(rope: dict, text: dict, model_type: str) -> tuple:
    """YaRN's parameters resolved as HF transformers resolves them; any other scaled RoPE is refused."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return ()
    if kind != "yarn":
        raise ValueError(
            f"rope_type {kind!r} is not supported: pocketlab runs the default rotary embedding and YaRN "
            "(rope_type 'yarn'); running it as plain RoPE would give wrong logits"
        )
    if model_type not in DENSE_TYPES:
        raise ValueError(f"YaRN is supported for {DENSE_TYPES} only, not {model_type!r}")
    if "factor" not in rope:
        raise ValueError("a yarn rope config needs 'factor'")
    params = {k: rope[k] for k in YARN_KEYS if rope.get(k) is not None}
    # a top-level original_max_position_embeddings wins, as in transformers
    params["original_max_position_embeddings"] = text.get(
        "original_max_position_embeddings",
        rope.get("original_max_position_embeddings") or text.get("max_position_embeddings", 32768),
    )
    if rope["factor"] is None:
        params["factor"] = text["max_position_embeddings"] / params["original_max_position_embeddings"]
    return tuple(sorted(params.items()))


def _fp8_block(quant: dict | None) -> tuple[int, ...]:
    """The FP8 weight block of a quantized checkpoint we can run (dequantized at load); ValueError for any
    other quantization, instead of failing later on tensors the engine does not know."""
    if not quant:
        return ()
    method = quant.get("quant_method")
    block = quant.get("weight_block_size")
    if method == "fp8" and block and len(block) == 2 and quant.get("activation_scheme", "dynamic") == "dynamic":
        return tuple(int(b) for b in block)
    what = f"quant_method {method!r}" + (" without weight_block_size" if method == "fp8" and not block else "")
    raise ValueError(
        f"this checkpoint is quantized ({what}, quantization_config {quant}); pocketlab runs unquantized weights "
        "and block-FP8 ones (quant_method 'fp8' with weight_block_size, dynamic activations), dequantized at "
        "load. Use the unquantized checkpoint."
    )


@dataclass
class EngineOptions:
    max_slots: int | str = 4  # "auto": as many as memory_fraction of the free device memory holds (pocketlab.memory)
    memory_fraction: float = 0.9  # of the device memory free at start that the engine may plan to use
    max_seq_len: int = 1024
    prefill_chunk: int = 2048  # longer prompts are prefilled in chunks of this many tokens
    device: str = "cpu"
    dtype: str = "float32"
    cuda_graphs: bool = True  # replay batch decode from captured graphs on CUDA
    # cuda_graphs: a greedy decode step launches the next step of its slots, fed its argmax on the device, before it
    # returns; the next call takes it where it feeds those tokens to those slots (any other call leaves it: one step
    # of GPU work lost). Hybrids store that step's Gated DeltaNet states aside (cache.aside_rows: small batches).
    decode_ahead: bool = True
    compile: bool = True  # fuse elementwise chains with torch.compile in captured decode graphs
    prefill_graph_tokens: int = 512  # cuda_graphs: prompt forwards of at most this many padded tokens replay graphs
    decode_attention: str = "auto"  # "triton" (live keys read in place), "sdpa", or "auto": triton on CUDA
    linear_decode: str = "auto"  # Gated DeltaNet decode: "triton" (states updated in place), "torch", "auto"
    linear_in_place_tokens: int = 0  # with linear_decode's in-place kernels: forwards of at most this many tokens too
    fused_linear: str = "auto"  # few-row projections with their residual add / SwiGLU in one Triton kernel
    gemv_rows: int = 1  # fused_linear: projections of at most this many rows stream their weight (layers.gemv); 0: off
    # fused_linear, not batch_invariant: each pre-norm's weight multiplied into the projection that reads it (qkv,
    # in_proj, a dense gate_up) at load, so a launch norms a row as one scalar, not a launch of its own: "auto" where
    # gate_up's one-row call takes the fused matmul (past the GEMV's weight limit: 8B, 9B) and on GPUs whose few-row
    # matmuls take the TMA ring (layers.matmul_tma: sm_90), "always", "never"
    fold_norm_weights: str = "auto"
    moe_kernel: str = "auto"  # routed experts: "triton" (layers.moe_kernel), "torch" (grouped_mm), "auto": GPU triton
    moe_gemv_tokens: int = 1  # with both Triton paths: MoE blocks of at most this many tokens take layers.moe_gemv
    graph_batch_sizes: tuple[int, ...] = field(default=(1, 2, 4, 8, 16, 32, 64))
    batch_invariant: bool = False  # logits bitwise independent of the batch (Triton kernels; CPU: interpreter)
    speculative_tokens: int = 0  # drafts per decode step (MTP head), verified in one forward; 0: off
    speculative_rollback: str = "states"  # GDN state after a rejection: per-token "states" kept, or "replay"
    prefix_cache: bool = True  # reuse K/V and states of shared prompt prefixes (per slot and across slots)
    prefix_cache_bytes: int = 1 << 30  # budget for retained prefixes and state checkpoints (live slots never count)
    prefix_block: int = 16  # tokens per hashed block in the cross-slot lookup
    checkpoint_stride: int = 512  # hybrid: also checkpoint the recurrent state at multiples of this (0: prompt ends)
    tensor_parallel: int = 1  # processes (one per device) the weights are sharded over; see pocketlab.parallel
    parallel_timeout_s: float = 120.0  # tensor_parallel > 1: a collective waiting longer means a rank died or hung
    warmup: bool = False  # capture every graph and compile every kernel variant at construction (engine.warmup)

    def __post_init__(self):
        if not 0 <= self.speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_tokens={self.speculative_tokens}: need 0 <= k <= {MAX_SPECULATIVE_TOKENS}")
        if self.speculative_rollback not in ("replay", "states"):
            raise ValueError(f"speculative_rollback {self.speculative_rollback!r} is not one of replay, states")
        if not (isinstance(self.tensor_parallel, int) and self.tensor_parallel >= 1):
            raise ValueError(f"tensor_parallel={self.tensor_parallel!r}: need an int >= 1 (processes to split over)")
        if self.parallel_timeout_s <= 0:
            raise ValueError(f"parallel_timeout_s={self.parallel_timeout_s}: need a positive number of seconds")
        if self.tensor_parallel > 1 and self.batch_invariant:
            raise ValueError("batch_invariant=True is not supported with tensor_parallel > 1 (its kernels run unsplit)")
        if self.batch_invariant:
            self._check_batch_invariant()
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {list(DTYPES)}")
        if self.decode_attention not in ("auto", "triton", "sdpa"):
            raise ValueError(f"decode_attention {self.decode_attention!r} is not one of auto, triton, sdpa")
        for name in ("linear_decode", "fused_linear", "moe_kernel"):
            if getattr(self, name) not in ("auto", "triton", "torch"):
                raise ValueError(f"{name} {getattr(self, name)!r} is not one of auto, triton, torch")
        if self.fold_norm_weights not in ("auto", "always", "never"):
            raise ValueError(f"fold_norm_weights {self.fold_norm_weights!r} is not one of auto, always, never")
        if not 0 <= self.gemv_rows <= GEMV_MAX_ROWS:
            raise ValueError(f"gemv_rows={self.gemv_rows}: need 0 <= rows <= {GEMV_MAX_ROWS} (layers.gemv's launch)")
        for name in ("moe_gemv_tokens", "linear_in_place_tokens", "prefill_graph_tokens"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 0):
                raise ValueError(f"{name}={getattr(self, name)!r}: need an int >= 0 (0: off)")
        if self.max_slots != "auto" and not (isinstance(self.max_slots, int) and self.max_slots >= 1):
            raise ValueError(f"max_slots={self.max_slots!r}: an int >= 1, or 'auto'")
        if self.max_seq_len < 2 or self.prefill_chunk < 1:
            raise ValueError("max_seq_len >= 2 and prefill_chunk >= 1 are required")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction={self.memory_fraction}: need 0 < fraction <= 1")
        if self.prefix_cache_bytes < 0 or self.prefix_block < 1 or self.checkpoint_stride < 0:
            raise ValueError("prefix_cache_bytes >= 0, prefix_block >= 1 and checkpoint_stride >= 0 are required")

    def launches_ahead(self, cfg: ModelConfig) -> bool:
        """decode_ahead where a step launched ahead and left unserved changes nothing a later call sees: on one
        device, without speculative drafts, and outside batch-invariant mode for Gated DeltaNet layers (whose
        token-by-token kernels there store in place; their decode step stores aside)."""
        single = self.tensor_parallel == 1 and not self.speculative_tokens  # one device, one token a step
        return self.decode_ahead and single and not (cfg.linear_layers and self.batch_invariant)

    @property
    def slot_count(self) -> int:
        """max_slots as a number; "auto" becomes one only in memory.resolve, which the engine runs first."""
        if isinstance(self.max_slots, str):
            raise ValueError("max_slots='auto' is not resolved yet: memory.resolve(cfg, options) resolves it")
        return self.max_slots

    def _check_batch_invariant(self) -> None:
        if self.fold_norm_weights == "always":
            raise ValueError("batch_invariant=True norms rows in kernels of their own: no fold_norm_weights 'always'")
        if importlib.util.find_spec("triton") is None:
            raise ValueError("batch_invariant=True runs Triton kernels: install triton")
        if torch.device(self.device).type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "batch_invariant=True on the CPU runs the Triton kernels in Triton's interpreter: set "
                "TRITON_INTERPRET=1 in the environment before Python starts"
            )
        if self.speculative_rollback != "states":
            raise ValueError("batch_invariant=True rolls speculative drafts back by kept states: use rollback 'states'")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
