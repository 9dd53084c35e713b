"""Checkpoint folder -> validated tensors. safetensors only: weights are never unpickled."""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import cast

import torch
from safetensors import SafetensorError, safe_open

from .config import ModelConfig

# Prefixes under which HF stores the language model; everything else (vision tower) is skipped.
_TEXT_PREFIXES = ("model.language_model.", "model.")
_IGNORED_PREFIXES = ("model.visual.", "visual.")


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the engine needs, by our canonical name (HF's text-only layout), with its shape."""
    d = cfg.hidden_size
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)}
        shapes |= mlp_shapes(cfg, p + "mlp.", cfg.is_moe_layer(i))
        if kind == "full_attention":
            shapes |= _attention_shapes(cfg, p + "self_attn.")
        else:
            shapes |= _linear_attention_shapes(cfg, p + "linear_attn.")
    if cfg.mtp_num_hidden_layers:
        shapes |= _mtp_shapes(cfg)
    return shapes


def mlp_shapes(cfg: ModelConfig, p: str, moe: bool) -> dict:
    """A dense SwiGLU MLP, or a sparse MoE block: router, experts stacked as the kernels read them (gate_up
    [E, 2 * I, d], down [E, d, I]: transformers' own in-memory layout) and Qwen3.5-MoE's gated shared expert."""
    d = cfg.hidden_size
    if not moe:
        i = cfg.intermediate_size
        return {p + "gate_proj.weight": (i, d), p + "up_proj.weight": (i, d), p + "down_proj.weight": (d, i)}
    e, i = cfg.num_experts, cfg.moe_intermediate_size
    shapes = {p + "gate.weight": (e, d), p + "experts.gate_up_proj": (e, 2 * i, d), p + "experts.down_proj": (e, d, i)}
    if cfg.shared_expert_intermediate_size:
        s = cfg.shared_expert_intermediate_size
        shapes |= {
            p + "shared_expert.gate_proj.weight": (s, d),
            p + "shared_expert.up_proj.weight": (s, d),
            p + "shared_expert.down_proj.weight": (d, s),
            p + "shared_expert_gate.weight": (1, d),
        }
    return shapes


def _attention_shapes(cfg: ModelConfig, p: str) -> dict:
    d, hd, nq, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    q_out = nq * hd * (2 if cfg.is_hybrid else 1)  # hybrid q_proj emits [q | gate] per head
    shapes: dict[str, tuple[int, ...]] = {
        p + "q_proj.weight": (q_out, d),
        p + "k_proj.weight": (nkv * hd, d),
        p + "v_proj.weight": (nkv * hd, d),
        p + "o_proj.weight": (d, nq * hd),
    }
    if cfg.attention_bias:
        shapes |= {p + "q_proj.bias": (q_out,), p + "k_proj.bias": (nkv * hd,), p + "v_proj.bias": (nkv * hd,)}
    if cfg.model_type != "qwen2":
        shapes |= {p + "q_norm.weight": (hd,), p + "k_norm.weight": (hd,)}
    return shapes


def _linear_attention_shapes(cfg: ModelConfig, p: str) -> dict:
    d, hv, dv, conv_dim = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_conv_dim
    return {
        p + "in_proj_qkv.weight": (conv_dim, d),
        p + "in_proj_z.weight": (hv * dv, d),
        p + "in_proj_b.weight": (hv, d),
        p + "in_proj_a.weight": (hv, d),
        p + "conv1d.weight": (conv_dim, 1, cfg.linear_conv_kernel_dim),
        p + "dt_bias": (hv,),
        p + "A_log": (hv,),
        p + "norm.weight": (dv,),
        p + "out_proj.weight": (d, hv * dv),
    }


def _mtp_shapes(cfg: ModelConfig) -> dict:
    d = cfg.hidden_size
    shapes = {
        "mtp.fc.weight": (d, 2 * d),
        "mtp.pre_fc_norm_embedding.weight": (d,),
        "mtp.pre_fc_norm_hidden.weight": (d,),
        "mtp.norm.weight": (d,),
    }
    for i in range(cfg.mtp_num_hidden_layers):
        p = f"mtp.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)}
        shapes |= mlp_shapes(cfg, p + "mlp.", cfg.is_moe_layer(None)) | _attention_shapes(cfg, p + "self_attn.")
    return shapes


def canonical_name(name: str) -> str | None:
    """Map a checkpoint tensor name to our canonical one; None for tensors we deliberately skip."""
    if name.startswith(_IGNORED_PREFIXES):
        return None
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model.") :]
    if name.startswith("model.mtp."):
        return name[len("model.") :]
    return name


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / s for s in shards]
    else:
        files = sorted(path.glob("*.safetensors"))
    missing = [f.name for f in files if not f.is_file()]
    if not files or missing:
        raise ValueError(
            f"{path}: no safetensors weights found"
            if not files
            else f"{path}: shards listed in the index are missing: {missing}"
        )
    return files


def load_weights(
    path: str | Path, cfg: ModelConfig, device: str = "cpu", dtype: torch.dtype = torch.float32, speculative_tokens=0
) -> dict[str, torch.Tensor]:
    """Read and validate every tensor; a missing, extra or misshapen tensor is an error naming it. Block-FP8
    weights are dequantized here (to `dtype`); a declared MTP head may be absent unless speculation is asked for."""
    path = Path(path)
    tensors = {}
    for file in checkpoint_files(path):
        with readable(file), safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                canon = canonical_name(name)
                if canon is None or (canon.startswith("mtp.") and not cfg.mtp_num_hidden_layers):
                    continue
                if canon in tensors:
                    raise ValueError(f"{file.name}: tensor {name!r} appears twice in the checkpoint")
                tensors[canon] = f.get_tensor(name)
    tensors = stack_experts(dequantize_fp8(tensors, cfg.fp8_weight_block))
    return warn_nonfinite(
        validate_weights(tensors, optional_mtp(cfg, tensors, speculative_tokens), device, dtype), path
    )


def optional_mtp(cfg: ModelConfig, tensors: dict, speculative_tokens: int) -> ModelConfig:
    """cfg, or cfg without its MTP head when the weights lack every mtp.* tensor (transformers drops them when it
    re-saves a checkpoint) and no speculation is asked for; asking for it then is an error that says why."""
    if not cfg.mtp_num_hidden_layers or any(n.startswith("mtp.") for n in tensors):
        return cfg
    if speculative_tokens:
        raise ValueError(
            f"speculative_tokens={speculative_tokens} drafts with the MTP head, but this checkpoint declares "
            f"mtp_num_hidden_layers={cfg.mtp_num_hidden_layers} and holds no mtp.* tensors (transformers drops "
            "them when it re-saves a model): use the original checkpoint, or speculative_tokens=0"
        )
    return dataclasses.replace(cfg, mtp_num_hidden_layers=0)


def dequantize_fp8(tensors: dict[str, torch.Tensor], block: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Block-FP8 checkpoints (e.g. Qwen/Qwen3-8B-FP8): each quantized `X.weight` is float8_e4m3fn with a float32
    `X.weight_scale_inv` holding one multiplier per block of `block` rows x cols (edge blocks partial); embeddings,
    norms and lm_head stay unquantized. Returns float32 weights in place of each pair."""
    scales = {n for n in tensors if n.endswith(".weight_scale_inv")}
    if not block:
        if scales:
            raise ValueError(
                f"the checkpoint holds {len(scales)} FP8 scale tensor(s), e.g. {sorted(scales)[:2]}, but config.json "
                "has no quantization_config with quant_method 'fp8' and weight_block_size"
            )
        return tensors
    out = {n: t for n, t in tensors.items() if n not in scales}
    for name in sorted(scales):
        wname = name.removesuffix("_scale_inv")
        w, s = tensors.get(wname), tensors[name]
        if w is None:
            raise ValueError(f"FP8 scale {name!r} has no weight {wname!r}")
        rows, cols = -(-w.shape[0] // block[0]), -(-w.shape[1] // block[1])
        if w.dim() != 2 or tuple(s.shape) != (rows, cols):
            raise ValueError(
                f"FP8 weight {wname!r} {tuple(w.shape)} needs scales of shape {(rows, cols)} for blocks of {block}, "
                f"found {tuple(s.shape)}"
            )
        full = s.float().repeat_interleave(block[0], 0)[: w.shape[0]].repeat_interleave(block[1], 1)[:, : w.shape[1]]
        out[wname] = w.float() * full
    raw = sorted(n for n, t in out.items() if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2))
    if raw:
        raise ValueError(f"{len(raw)} FP8 tensor(s) have no weight_scale_inv, e.g. {raw[:3]}")
    return out


_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The hub's (and transformers' save_pretrained's) per-expert tensors `...mlp.experts.{e}.gate_proj.weight` /
    `up_proj` / `down_proj`, stacked once into `...mlp.experts.gate_up_proj` [E, 2 * I, d] ([gate | up] rows per
    expert) and `...mlp.experts.down_proj` [E, d, I]; already-stacked checkpoints (a transformers state_dict) pass.
    A block missing an expert, or one projection of it, is an error naming it."""
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name in [n for n in tensors if _EXPERT.match(n)]:
        block, e, proj = cast(re.Match[str], _EXPERT.match(name)).groups()
        groups.setdefault(block, {}).setdefault(int(e), {})[proj] = tensors.pop(name)
    for block, experts in groups.items():
        n = max(experts) + 1
        for e in range(n):
            lacking = [p for p in ("gate_proj", "up_proj", "down_proj") if p not in experts.get(e, {})]
            if lacking:
                raise ValueError(f"{block}: expert {e} of {n} lacks {lacking} (tensor {block}.{e}.{lacking[0]}.weight)")
        shapes = {tuple(t.shape) for x in experts.values() for t in x.values()}
        if (
            len({tuple(x[p].shape) for x in experts.values() for p in ("gate_proj", "up_proj")}) != 1
            or len({tuple(x["down_proj"].shape) for x in experts.values()}) != 1
        ):
            raise ValueError(f"{block}: experts of different shapes {sorted(shapes)}")
        if block + ".gate_up_proj" in tensors or block + ".down_proj" in tensors:
            raise ValueError(f"{block}: both per-expert and stacked expert tensors in the checkpoint")
        tensors[block + ".gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]]) for e in range(n)]
        )
        tensors[block + ".down_proj"] = torch.stack([experts[e]["down_proj"] for e in range(n)])
    return tensors


@contextmanager
def readable(file: Path):
    """safetensors' own errors (truncated file, a header claiming more bytes than there are, broken JSON, offsets
    past the end) and OS errors, as a ValueError naming the file."""
    try:
        yield
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file}: not a readable safetensors file ({type(e).__name__}: {e})") from None


def warn_nonfinite(tensors: dict[str, torch.Tensor], path) -> dict[str, torch.Tensor]:
    """Warn about NaN/inf weights (a damaged file or a diverged training run): they load, but every logit they touch
    is NaN. safetensors has no checksum, so this is the one trace a flipped data bit may leave."""
    bad = [n for n, t in tensors.items() if not bool(torch.isfinite(t).all())]
    if bad:
        warnings.warn(f"{path}: {len(bad)} tensor(s) hold NaN or inf, e.g. {bad[:3]}", RuntimeWarning, stacklevel=3)
    return tensors


def validate_weights(
    tensors: dict[str, torch.Tensor], cfg: ModelConfig, device="cpu", dtype=torch.float32
) -> dict[str, torch.Tensor]:
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # some writers (and state_dict()) carry the tied copy too
    expected = expected_shapes(cfg)
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:5]}")
    if extra:
        raise ValueError(f"checkpoint has {len(extra)} unexpected tensor(s), e.g. {extra[:5]}")
    for name, shape in expected.items():
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, config implies {shape}")
        if not t.is_floating_point():
            raise ValueError(f"tensor {name!r} has dtype {t.dtype}, expected a floating-point tensor")
    # A_log and dt_bias drive an exp(); keep them (and the fp32 state they feed) in float32.
    keep_fp32 = ("A_log", "dt_bias")
    return {n: _placed(t, device, torch.float32 if n.endswith(keep_fp32) else dtype) for n, t in tensors.items()}


def _placed(t: torch.Tensor, device, dtype) -> torch.Tensor:
    """t on device in dtype, starting 16-byte aligned as vectorized and TMA loads want it: a tensor the file's own
    buffer already holds as asked (the CPU in the file's dtype) can sit at any 8-byte offset there, and is copied."""
    t = t.to(device=device, dtype=dtype)
    return t if t.data_ptr() % 16 == 0 else t.clone()
