"""Checkpoints: single file and sharded load alike; broken ones fail naming the tensor."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pocketlab import EngineOptions, ModelConfig, QwenEngine
from pocketlab.loader import load_weights
from pocketlab.tools.synthetic import write_checkpoint


@pytest.fixture
def broken(checkpoint, tmp_path):
    """A writable copy of the tiny checkpoint and its tensors, to damage."""
    src = checkpoint("tiny-qwen3")
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst, load_file(dst / "model.safetensors")


def test_sharded_equals_single_file(checkpoint, tmp_path):
    sharded = write_checkpoint("tiny-qwen3", tmp_path / "sharded", seed=0, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    cfg = ModelConfig.from_pretrained(sharded)
    a, b = load_weights(sharded, cfg), load_weights(checkpoint("tiny-qwen3"), cfg)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "damage,message",
    [
        ("drop", "missing 1 tensor"),
        ("extra", "unexpected tensor"),
        ("reshape", "has shape"),
        ("int", "floating-point"),
    ],
)
def test_broken_checkpoint_names_the_tensor(broken, damage, message):
    path, tensors = broken
    name = "model.layers.1.self_attn.k_proj.weight"
    if damage == "drop":
        del tensors[name]
    elif damage == "extra":
        tensors["model.layers.9.mlp.up_proj.weight"] = torch.zeros(2, 2)
    elif damage == "reshape":
        tensors[name] = tensors[name][:-1]
    else:
        tensors[name] = tensors[name].to(torch.int32)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=message) as err:
        QwenEngine.from_pretrained(path)
    assert "model.layers" in str(err.value)


def test_missing_weights_and_pickle_files_are_refused(broken):
    path, _ = broken
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="no safetensors"):
        QwenEngine.from_pretrained(path)


def test_missing_shard_and_bad_config(checkpoint, tmp_path):
    sharded = write_checkpoint("tiny-qwen3", tmp_path / "s", seed=0, max_shard_size="100KB")
    next(sharded.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(ValueError, match="missing"):
        QwenEngine.from_pretrained(sharded)
    with pytest.raises(ValueError, match="config.json"):
        QwenEngine.from_pretrained(tmp_path)
    cfg = json.loads((checkpoint("tiny-qwen3") / "config.json").read_text())
    with pytest.raises(ValueError, match="unsupported model_type"):
        ModelConfig.from_dict(cfg | {"model_type": "llama"})


def test_options_are_checked():
    with pytest.raises(ValueError, match="dtype"):
        EngineOptions(dtype="int8")
    for bad in (-1, 1.5):
        for name in ("moe_gemv_tokens", "linear_in_place_tokens", "prefill_graph_tokens"):
            with pytest.raises(ValueError, match=name):
                EngineOptions(**{name: bad})
