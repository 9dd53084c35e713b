"""Checkpoint variants people download: YaRN (both config spellings), block-FP8 weights, an MTP head declared but
dropped by a re-save, and quantization we cannot run. Each is written the way the real one is laid out, and
numerics are checked against HF transformers (float32: logits within 1e-4, same greedy tokens)."""

import json
import math
import shutil

import pytest
import torch
import transformers
from conftest import DEVICE, DTYPE, greedy_run, random_prompt
from safetensors.torch import load_file, save_file
from test_parity import assert_matches_reference, check_parity, hf_incremental_logits

from pocketlab import EngineOptions, ModelConfig, QwenEngine
from pocketlab.layers.gated_delta import backend_name
from pocketlab.tools.synthetic import write_checkpoint


def engine(path, **options):
    opts = dict(max_slots=1, max_seq_len=256, prefill_chunk=16, device=DEVICE, dtype=DTYPE) | options
    return QwenEngine.from_pretrained(path, EngineOptions(**opts))


def skip_hybrid_where_hf_is_tf32(preset: str) -> None:
    if preset.startswith("tiny-qwen3_5") and DTYPE == "float32" and backend_name(DEVICE) == "fla":
        pytest.skip("HF's float32 Qwen3.5 runs fla's TF32 chunk kernels on CUDA; the 1e-4 check runs on the CPU")


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg, indent=2))


# -- YaRN -----------------------------------------------------------------------------------------
YARN = dict(factor=4.0, original_max_position_embeddings=1024)


@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-qwen3"])
@pytest.mark.parametrize("spelling", ["legacy rope_scaling type", "rope_parameters rope_type"])
def test_yarn_matches_transformers(preset, spelling, tmp_path):
    path = write_checkpoint(preset, tmp_path / "yarn", seed=0)
    theta = json.loads((path / "config.json").read_text())["rope_parameters"]["rope_theta"]
    if spelling.startswith("legacy"):  # Qwen2.5's documented long-context recipe, as transformers 4.x wrote it
        edit_config(path, rope_parameters=None, rope_theta=theta, rope_scaling=dict(YARN, type="yarn"))
    else:  # transformers v5's spelling, with every optional knob set
        rope = dict(YARN, rope_type="yarn", rope_theta=theta, beta_fast=16, beta_slow=2, mscale=1.0)
        edit_config(path, rope_parameters=rope | dict(mscale_all_dim=0.5, truncate=False))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEVICE).eval()
    rotary = hf.model.rotary_emb
    assert rotary.rope_type == "yarn" and rotary.attention_scaling != 1.0  # the reference really runs YaRN
    assert ModelConfig.from_pretrained(path).yarn is not None
    prompt = random_prompt(40, seed=3)
    tokens, logits = greedy_run(engine(path), prompt, 8)
    ref = hf_incremental_logits(hf, prompt, tokens[:-1])
    assert_matches_reference(ref, logits, tokens)
    plain = hf_incremental_logits(
        transformers.AutoModelForCausalLM.from_pretrained(write_checkpoint(preset, tmp_path / "plain", seed=0)).to(
            DEVICE
        ),
        prompt,
        tokens[:-1],
    )
    assert (plain - ref).abs().max() > 1e-2  # YaRN changes the logits: plain RoPE would fail this test


@pytest.mark.parametrize(
    "rope",
    [
        dict(rope_type="linear", factor=2.0),
        dict(type="dynamic", factor=2.0),
        dict(rope_type="llama3", factor=8.0, low_freq_factor=1, high_freq_factor=4),
        dict(rope_type="longrope", short_factor=[1.0], long_factor=[1.0]),
    ],
)
def test_other_rope_types_are_refused(checkpoint, rope):
    cfg = json.loads((checkpoint("tiny-qwen3") / "config.json").read_text())
    with pytest.raises(ValueError, match="not supported"):
        ModelConfig.from_dict(cfg | {"rope_parameters": dict(rope, rope_theta=1e4)})


def test_yarn_on_a_hybrid_model_is_refused(checkpoint):
    cfg = json.loads((checkpoint("tiny-qwen3_5") / "config.json").read_text())
    rope = cfg["rope_parameters"] | dict(YARN, rope_type="yarn")
    with pytest.raises(ValueError, match="YaRN is supported for"):
        ModelConfig.from_dict(cfg | {"rope_parameters": rope})


# -- block FP8 ------------------------------------------------------------------------------------
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # as Qwen3-8B-FP8
QUANTIZED += ("in_proj_qkv", "in_proj_z", "out_proj")  # Qwen3.5's Gated DeltaNet projections


def quantize_blocks(w, block):
    """Reference block quantizer, block by block: (fp8 weight, float32 scale_inv, the dequantized weight)."""
    rows, cols = math.ceil(w.shape[0] / block[0]), math.ceil(w.shape[1] / block[1])
    q, scale, deq = torch.empty(w.shape, dtype=torch.float8_e4m3fn), torch.empty(rows, cols), torch.empty(w.shape)
    for i in range(rows):
        for j in range(cols):
            r, c = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            scale[i, j] = w[r, c].abs().max() / FP8_MAX
            q[r, c] = (w[r, c] / scale[i, j]).to(torch.float8_e4m3fn)
            deq[r, c] = q[r, c].float() * scale[i, j]
    return q, scale, deq


@pytest.mark.parametrize(
    "preset,block",
    [("tiny-qwen3", [128, 128]), ("tiny-qwen3", [48, 32]), ("tiny-qwen3_5", [48, 32])],
)  # the real block; several and partial edge blocks; a hybrid model
def test_block_fp8_checkpoint_matches_transformers_on_its_dequantized_weights(checkpoint, tmp_path, preset, block):
    skip_hybrid_where_hf_is_tf32(preset)
    src = checkpoint(preset)
    path = tmp_path / "fp8"
    shutil.copytree(src, path)
    tensors, stored, reference = load_file(src / "model.safetensors"), {}, {}
    for name, w in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in QUANTIZED:
            q, s, deq = quantize_blocks(w, block)
            stored |= {name: q, name + "_scale_inv": s}
            reference[name] = deq
        else:  # embeddings, norms, lm_head: unquantized, bf16 as in the real checkpoint
            stored[name] = w.to(torch.bfloat16)
            reference[name] = stored[name].float()
    save_file(stored, path / "model.safetensors", metadata={"format": "pt"})
    quant = dict(quant_method="fp8", activation_scheme="dynamic", fmt="e4m3", weight_block_size=block)
    edit_config(path, quantization_config=quant)

    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    hf.load_state_dict(reference, strict=False)
    hf = hf.to(DEVICE)
    prompt = random_prompt(24, seed=5)
    tokens, logits = greedy_run(engine(path), prompt, 8)
    assert_matches_reference(hf_incremental_logits(hf, prompt, tokens[:-1]), logits, tokens)
    err = max((reference[n] - tensors[n]).abs().max().item() for n in reference if n in stored and "_proj" in n)
    assert err > 1e-3  # the FP8 rounding is really there (so the scales are really applied)


@pytest.mark.parametrize(
    "quant,message",
    [
        (dict(quant_method="awq", bits=4, group_size=128), "quant_method 'awq'"),
        (dict(quant_method="gptq", bits=4), "quant_method 'gptq'"),
        (dict(quant_method="bitsandbytes", load_in_4bit=True), "quant_method 'bitsandbytes'"),
        (dict(quant_method="fp8", activation_scheme="dynamic"), "without weight_block_size"),
        (dict(quant_method="fp8", activation_scheme="static", weight_block_size=[128, 128]), "quantized"),
    ],
)
def test_quantization_we_cannot_run_is_refused_clearly(checkpoint, tmp_path, quant, message):
    path = tmp_path / "q"
    shutil.copytree(checkpoint("tiny-qwen3"), path)
    edit_config(path, quantization_config=quant)
    with pytest.raises(ValueError, match="is quantized") as err:
        QwenEngine.from_pretrained(path)
    assert message in str(err.value)


def test_fp8_scales_without_a_quantization_config_are_refused(checkpoint, tmp_path):
    path = tmp_path / "s"
    shutil.copytree(checkpoint("tiny-qwen3"), path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight_scale_inv"] = torch.ones(1, 1)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match="no quantization_config"):
        QwenEngine.from_pretrained(path)


# -- MTP head declared, tensors dropped -----------------------------------------------------------
def test_mtp_head_is_optional_unless_speculation_is_asked_for(checkpoint, tmp_path):
    skip_hybrid_where_hf_is_tf32("tiny-qwen3_5-mtp")
    path = tmp_path / "resaved"
    shutil.copytree(checkpoint("tiny-qwen3_5-mtp"), path)
    tensors = load_file(path / "model.safetensors")
    kept = {k: v for k, v in tensors.items() if not k.startswith(("mtp.", "model.mtp."))}
    assert len(kept) < len(tensors)
    save_file(kept, path / "model.safetensors")
    assert ModelConfig.from_pretrained(path).mtp_num_hidden_layers == 1
    eng = engine(path)
    assert eng.cfg.mtp_num_hidden_layers == 0
    check_parity(eng, path, length=12, steps=4)
    with pytest.raises(ValueError, match="holds no mtp"):
        engine(path, speculative_tokens=1)
