"""Hostile files: damaged, foreign or tampered weights and snapshots are each a clear ValueError naming the file and
what is wrong (NaN/inf weights a warning), nothing is loaded half-way, and nothing is ever unpickled."""

import json
import pickle
import shutil
import struct
import warnings

import pytest
import torch
from conftest import assert_same_state, engine_state, random_prompt
from safetensors.torch import save_file

from pocketlab import EngineOptions, QwenEngine, Snapshot
from pocketlab.cache import SNAPSHOT_VERSION, _digest
from pocketlab.verify import fuzz

TRIED = {"weights": 0, "snapshots": 0}  # hostile files tried, for the reliability table


@pytest.fixture
def folder(checkpoint, tmp_path):
    """A private copy of the tiny Qwen3 checkpoint, free to damage."""
    dst = tmp_path / "ckpt"
    shutil.copytree(checkpoint("tiny-qwen3"), dst)
    return dst


def header(data: bytes) -> tuple[int, dict]:
    n = struct.unpack("<Q", data[:8])[0]
    return n, json.loads(data[8 : 8 + n])


def with_header(data: bytes, head: dict) -> bytes:
    n = struct.unpack("<Q", data[:8])[0]
    raw = json.dumps(head).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data[8 + n :]


def load(folder):
    TRIED["weights"] += 1
    return QwenEngine.from_pretrained(folder, EngineOptions(max_slots=1, max_seq_len=32))


def damage(folder, how) -> bytes:
    file = folder / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(how(data))
    return data


def offsets_past_end(data):
    _, head = header(data)
    name = next(k for k in head if k != "__metadata__")
    head[name]["data_offsets"][1] += 1 << 20
    return with_header(data, head)


def wrong_dtype(data):
    _, head = header(data)
    head["model.norm.weight"]["dtype"] = "I32"  # same size as F32: only the dtype is wrong
    return with_header(data, head)


WEIGHT_DAMAGE = {
    "truncated data": (lambda d: d[:-100], "not a readable safetensors"),
    "truncated header": (lambda d: d[:20], "not a readable safetensors"),
    "empty file": (lambda d: b"", "not a readable safetensors"),
    "header claims more bytes than the file has": (
        lambda d: struct.pack("<Q", len(d) * 2) + d[8:],
        "not a readable safetensors",
    ),
    "tensor offsets past the end": (offsets_past_end, "not a readable safetensors"),
    "header JSON broken": (lambda d: d[:8] + b"}" + d[9:], "not a readable safetensors"),
    "integer dtype": (wrong_dtype, "floating-point"),
}


@pytest.mark.parametrize("case", list(WEIGHT_DAMAGE))
def test_damaged_weights_are_a_clear_error(folder, case):
    how, message = WEIGHT_DAMAGE[case]
    damage(folder, how)
    with pytest.raises(ValueError, match=message) as e:
        load(folder)
    assert case == "integer dtype" or "model.safetensors" in str(e.value)


def test_every_header_bit_flip_is_refused_or_harmless(folder, checkpoint):
    """A flipped bit in the header either breaks it (a clear error) or leaves a header that reads the same weights
    (e.g. inside the metadata's free text): never different weights silently."""
    original = load(checkpoint("tiny-qwen3"))
    n, _ = header((folder / "model.safetensors").read_bytes())
    for pos in range(8, 8 + n, max(1, n // 40)):
        for bit in (0, 5):
            data = damage(folder, lambda d, p=pos, b=bit: d[:p] + bytes([d[p] ^ (1 << b)]) + d[p + 1 :])
            try:
                eng = load(folder)
            except ValueError:
                pass
            else:
                assert eng.model_id == original.model_id, f"byte {pos} bit {bit}: other weights loaded silently"
            (folder / "model.safetensors").write_bytes(data)


def test_nan_and_inf_weights_warn(folder):
    def poison(data):
        n, head = header(data)
        lo = head["model.layers.0.mlp.up_proj.weight"]["data_offsets"][0]
        start = 8 + n + lo
        return data[:start] + struct.pack("<ff", float("nan"), float("inf")) + data[start + 8 :]

    damage(folder, poison)
    with pytest.warns(RuntimeWarning, match="NaN or inf.*up_proj"):
        load(folder)


def test_pickles_are_never_loaded(folder, tmp_path):
    """A folder with only a pickled pytorch_model.bin is refused, and the pickle never runs."""
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    for f in folder.glob("*.safetensors"):
        f.unlink()
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(ValueError, match="no safetensors weights"):
        load(folder)
    assert not marker.exists()


# -- snapshots ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engines(make_engine):
    """A hybrid engine with a sequence in slot 0, and another with different weights (and the same shapes)."""
    eng = make_engine("tiny-qwen3_5", max_slots=2, max_seq_len=64)
    eng.prefill(random_prompt(13, seed=4), slot_id=0)
    return eng


def resave(path, edit):
    """Rewrite a snapshot file's metadata with edit(meta) and a matching checksum (a consistent file, other facts)."""
    snap = Snapshot.load(path)
    meta = edit(snap._metadata())
    tensors = {k: v.contiguous() for k, v in snap.tensors.items()}
    save_file(tensors, str(path), metadata=meta | {"sha256": _digest(meta, tensors)})


def flip(path, pos):
    data = bytearray(path.read_bytes())
    data[pos] ^= 0x10
    path.write_bytes(bytes(data))


SNAPSHOT_DAMAGE = {
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:-64]), "not a readable safetensors"),
    "cut to its header": (lambda p: p.write_bytes(p.read_bytes()[:100]), "not a readable safetensors"),
    "a data bit flipped": (lambda p: flip(p, p.stat().st_size - 5), "checksum mismatch"),
    "token history tampered": (
        lambda p: p.write_bytes(p.read_bytes().replace(b'"tokens":"', b'"tokens":"1,')),
        "not a readable|checksum",
    ),
    "another engine version": (lambda p: resave(p, lambda m: m | {"version": "0"}), "format version '0'"),
    "not a snapshot": (lambda p: save_file({"x": torch.zeros(1)}, str(p)), "not a pocketlab snapshot"),
    "NaN state": (lambda p: nan_state(p), "NaN or inf"),
}


def nan_state(path):
    snap = Snapshot.load(path)
    name = next(k for k in snap.tensors if k.startswith("rec."))
    snap.tensors[name][0, 0, 0] = float("nan")
    snap.save(path)


@pytest.mark.parametrize("case", list(SNAPSHOT_DAMAGE))
def test_damaged_snapshot_is_a_clear_error_and_changes_nothing(engines, case, tmp_path):
    path = tmp_path / "snap.safetensors"
    engines.snapshot(0).save(path)
    damage_it, message = SNAPSHOT_DAMAGE[case]
    damage_it(path)
    before = engine_state(engines)
    TRIED["snapshots"] += 1
    with pytest.raises(ValueError, match=message) as e:
        engines.restore(Snapshot.load(path), slot_id=1)
    assert case == "NaN state" or str(path) in str(e.value)
    assert_same_state(before, engine_state(engines))


def test_every_byte_of_a_snapshot_file_is_covered(engines, tmp_path):
    """Flipping any sampled byte of a snapshot file (header or data) is refused: nothing restores a changed file."""
    path = tmp_path / "snap.safetensors"
    engines.snapshot(0).save(path)
    clean = path.read_bytes()
    for pos in range(0, len(clean), max(1, len(clean) // 200)):
        path.write_bytes(clean)
        flip(path, pos)
        TRIED["snapshots"] += 1
        with pytest.raises(ValueError):
            engines.restore(Snapshot.load(path), slot_id=1)


def test_snapshot_from_another_model_or_dtype_is_refused(engines, checkpoint, tmp_path):
    """Same shapes, other weights: only the model id tells. Another dtype: the dtype tells. Via a file too."""
    other = QwenEngine.from_pretrained(
        checkpoint("tiny-qwen3_5", initializer_range=0.05), EngineOptions(max_slots=2, max_seq_len=64)
    )
    other.prefill([1, 2, 3], slot_id=0)
    bf16 = QwenEngine.from_pretrained(
        checkpoint("tiny-qwen3_5"), EngineOptions(max_slots=2, max_seq_len=64, dtype="bfloat16")
    )
    bf16.prefill([1, 2, 3], slot_id=0)
    assert bf16.model_id == engines.model_id != other.model_id  # one checkpoint, one id, in every dtype
    before = engine_state(engines)
    for snap, message in ((other.snapshot(0), "another model"), (bf16.snapshot(0), "holds bfloat16 state")):
        snap.save(tmp_path / "s.safetensors")
        for s in (snap, Snapshot.load(tmp_path / "s.safetensors")):
            TRIED["snapshots"] += 1
            with pytest.raises(ValueError, match=message):
                engines.restore(s, slot_id=1)
    assert_same_state(before, engine_state(engines))


def test_a_clean_snapshot_file_round_trips(engines, tmp_path):
    """The checks refuse only what is wrong: the file as written restores, with its format version."""
    engines.snapshot(0).save(tmp_path / "s.safetensors")
    snap = Snapshot.load(tmp_path / "s.safetensors")
    assert snap._metadata()["version"] == SNAPSHOT_VERSION and snap.model == engines.model_id
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engines.restore(snap, slot_id=1)
    assert engines.cache.slots[1].tokens == engines.cache.slots[0].tokens


def teardown_module():
    fuzz.STATS["hostile weight files tried"] += TRIED["weights"]
    fuzz.STATS["hostile snapshot files tried"] += TRIED["snapshots"]
    if fuzz.STATS_FILE:
        fuzz.write_stats(fuzz.STATS_FILE)
