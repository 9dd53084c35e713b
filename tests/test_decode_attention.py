"""The Triton decode-attention kernel against plain softmax attention (GPU, or Triton's CPU interpreter)."""

import os

import pytest
import torch

from pocketlab.layers import decode_attention as da
from pocketlab.layers.norm import _rms_norm
from pocketlab.layers.rotary import apply_rotary

on_gpu = torch.cuda.is_available()
interpreted = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(
    da.triton is None or not (on_gpu or interpreted), reason="needs Triton on a GPU (or TRITON_INTERPRET=1)"
)


@pytest.mark.parametrize(
    "heads,kv_heads,dim,max_len,rot,norm",
    [(16, 8, 128, 600, 128, "w"), (8, 2, 256, 300, 64, "1+w"), (4, 2, 16, 64, 16, None), (4, 1, 16, 2000, 8, "w")],
)
def test_matches_reference_and_stores_the_new_token(heads, kv_heads, dim, max_len, rot, norm):
    """Raw q/k in: per-head RMSNorm (Qwen3 w*x, Qwen3.5 (1+w)*x, Qwen2 none) and (partial) RoPE applied in the
    kernel exactly as layers.norm / layers.rotary do; the new K/V stored; attention over each slot's live keys."""
    dev = "cuda" if on_gpu else "cpu"
    gen = torch.Generator(device="cpu").manual_seed(max_len)
    k_cache, v_cache = (torch.randn(4, kv_heads, max_len, dim, generator=gen).to(dev) for _ in range(2))
    q = torch.randn(3, heads, dim, generator=gen).to(dev)
    k_new, v_new = (torch.randn(3, kv_heads, dim, generator=gen).to(dev) for _ in range(2))
    cos, sin = (torch.randn(3, rot, generator=gen).to(dev) for _ in range(2))
    slots, lengths = torch.tensor([2, 0, 3], device=dev), torch.tensor([max_len - 5, 1, 37], device=dev)
    norms = None
    if norm is not None:
        norms = (torch.randn(dim, generator=gen).to(dev), torch.randn(dim, generator=gen).to(dev), 1e-6, norm == "1+w")
        q_ref, k_ref_new = _rms_norm(q, norms[0], 1e-6, norms[3]), _rms_norm(k_new, norms[1], 1e-6, norms[3])
    else:
        q_ref, k_ref_new = q, k_new
    q_ref = apply_rotary(q_ref, cos[:, None], sin[:, None])
    k_ref_new = apply_rotary(k_ref_new, cos[:, None], sin[:, None])
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    k_ref[slots, :, lengths - 1], v_ref[slots, :, lengths - 1] = k_ref_new, v_new
    out = da.decode_attention(q, k_new, v_new, k_cache, v_cache, slots, lengths, max_len, dim**-0.5, (cos, sin), norms)
    assert (k_cache - k_ref).abs().max() < 1e-5 and torch.equal(v_cache, v_ref)  # the new token, nothing else
    for b in range(3):
        k = k_ref[slots[b], :, : lengths[b]].repeat_interleave(heads // kv_heads, 0)
        v = v_ref[slots[b], :, : lengths[b]].repeat_interleave(heads // kv_heads, 0)
        probs = torch.softmax(torch.einsum("hd,hnd->hn", q_ref[b], k) * dim**-0.5, -1)
        assert (out[b] - torch.einsum("hn,hnd->hd", probs, v)).abs().max() < 1e-4


def test_bf16_attends_as_float32_does():
    """The same bf16-valued inputs in bf16 and in float32: outputs within bf16's rounding. (Triton's interpreter
    multiplies bf16 tiles as their raw 16-bit integers, so its dots take float32 operands: invariant.dot.)"""
    dev = "cuda" if on_gpu else "cpu"
    gen = torch.Generator(device="cpu").manual_seed(3)
    inputs = [torch.randn(*shape, generator=gen).to(torch.bfloat16) for shape in
              ((2, 2, 300, 32), (2, 2, 300, 32), (1, 4, 32), (1, 2, 32), (1, 2, 32), (1, 32), (1, 32))]  # fmt: skip
    slots, lengths = torch.tensor([1], device=dev), torch.tensor([250], device=dev)
    outs = []
    for dtype in (torch.bfloat16, torch.float32):
        k_cache, v_cache, q, k, v, cos, sin = (t.to(dev, dtype) for t in inputs)
        outs.append(da.decode_attention(q, k, v, k_cache, v_cache, slots, lengths, 300, 32**-0.5, (cos, sin)))
    assert (outs[0].float() - outs[1]).abs().max() < 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_len", [600, 64])  # several key splits to merge; one
def test_the_output_gate_in_the_merge_is_sigmoid_gate_after_it(dtype, max_len):
    """gate= (Qwen3.5's output gate, a strided view as of the q projection): the merged output times sigmoid(gate),
    bit for bit what the row kernel's sigmoid_gate gives after an ungated call (torch's too in bf16; in float32 its
    sigmoid differs by an ulp), with several key splits to merge or one. A gate of another shape is refused."""
    from pocketlab.layers.activations import sigmoid_gate
    from pocketlab.layers.invariant import sigmoid_gate as row_sigmoid_gate

    dev = "cuda" if on_gpu else "cpu"
    gen = torch.Generator(device="cpu").manual_seed(5)
    heads, kv_heads, dim = 8, 2, 32

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dev, dtype)

    k_cache, v_cache = randn(4, kv_heads, max_len, dim), randn(4, kv_heads, max_len, dim)
    q_and_gate = randn(3, heads, 2 * dim) * 2
    q, gate = q_and_gate[..., :dim], q_and_gate[..., dim:]
    k_new, v_new = randn(3, kv_heads, dim), randn(3, kv_heads, dim)
    cos, sin = randn(3, dim), randn(3, dim)
    slots, lengths = torch.tensor([2, 0, 3], device=dev), torch.tensor([max_len - 5, 1, max_len // 2], device=dev)
    args = (q, k_new, v_new, k_cache, v_cache, slots, lengths, max_len, dim**-0.5, (cos, sin))
    out = da.decode_attention(*args)
    got = da.decode_attention(*args, gate=gate)
    assert (da.split_length(3 * kv_heads, max_len, 64) < max_len) == (max_len > 64)
    assert torch.equal(got, row_sigmoid_gate(out, gate))
    with pytest.raises(ValueError, match="gate"):
        da.decode_attention(*args, gate=gate[..., : dim // 2])
    torch.testing.assert_close(got, sigmoid_gate(out, gate), atol=0, rtol=0 if dtype == torch.bfloat16 else 1e-6)


@pytest.mark.parametrize("expanded", [False, True], ids=["rows", "one-row-expanded"])
def test_positions_pick_the_rows_of_the_rope_tables(expanded):
    """positions= (the engine's decode steps): each token reads row positions[b] of the whole cos/sin tables, the
    same output and cache bits as passing those rows gathered (rows out of order, one repeated; or one position
    for every token through a stride-0 view, as the shared_position mutant passes it)."""
    dev = "cuda" if on_gpu else "cpu"
    gen = torch.Generator(device="cpu").manual_seed(11)
    heads, kv_heads, dim, max_len = 4, 2, 16, 300
    caches = [torch.randn(4, kv_heads, max_len, dim, generator=gen).to(dev) for _ in range(2)]
    q, k_new, v_new = (torch.randn(3, n, dim, generator=gen).to(dev) for n in (heads, kv_heads, kv_heads))
    cos, sin = (torch.randn(max_len, dim, generator=gen).to(dev) for _ in range(2))
    slots, lengths = torch.tensor([2, 0, 3], device=dev), torch.tensor([250, 1, 37], device=dev)
    positions = torch.tensor([249, 36, 36], device=dev)
    if expanded:
        positions = positions[:1].expand(3)
    runs = []
    for rope, rows in (((cos[positions], sin[positions]), None), ((cos, sin), positions)):
        k_cache, v_cache = (c.clone() for c in caches)
        out = da.decode_attention(q, k_new, v_new, k_cache, v_cache, slots, lengths, max_len, dim**-0.5, rope,
                                  positions=rows)  # fmt: skip
        runs.append((out, k_cache, v_cache))
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


@pytest.mark.parametrize(
    "launch,programs,shape",
    [
        ("32:8:3:1", "", (4, 1, 16, 2000, 8, "w")),  # 32-key blocks over 2,000 keys in several splits
        ("256:8:1:1", "8", (4, 1, 16, 2000, 8, "w")),  # two splits of four 256-key blocks
        ("256:8:1:1", "8", (16, 8, 128, 256, 128, "w")),  # Qwen3-0.6B's heads: one split, one block, no merge
        ("128:4:1:1", "16", (16, 8, 128, 256, 128, "w")),  # one split of two blocks
    ],
)
def test_other_launches_attend_alike(monkeypatch, launch, programs, shape):
    """Other key blocks, warps, stages and split counts (POCKETLAB_ATTN_LAUNCH and POCKETLAB_ATTN_PROGRAMS, for the
    sweep and tools.ab) against the reference, the first blocks read before the PDL wait."""
    monkeypatch.setenv("POCKETLAB_ATTN_LAUNCH", launch)
    monkeypatch.setenv("POCKETLAB_ATTN_PROGRAMS", programs)
    test_matches_reference_and_stores_the_new_token(*shape)


@pytest.mark.parametrize("max_len", [4000, 64])  # several key splits of two blocks; one split of one
def test_the_first_block_read_before_the_wait_changes_no_bit(monkeypatch, max_len):
    """Launch.early reads each split's first block of cached K/V before the PDL wait: the same arithmetic on the
    same keys, so the same output and cache bits as the read after it, always (the default) or where a split holds
    several blocks (here at 4,000 keys, not at 64)."""
    dev = "cuda" if on_gpu else "cpu"
    gen = torch.Generator(device="cpu").manual_seed(7)
    heads, kv_heads, dim, rot = 4, 2, 16, 8
    caches = [torch.randn(4, kv_heads, max_len, dim, generator=gen).to(dev) for _ in range(2)]
    q, k_new, v_new = (torch.randn(3, n, dim, generator=gen).to(dev) for n in (heads, kv_heads, kv_heads))
    cos, sin = (torch.randn(3, rot, generator=gen).to(dev) for _ in range(2))
    norms = (torch.randn(dim, generator=gen).to(dev), torch.randn(dim, generator=gen).to(dev), 1e-6, False)
    slots, lengths = torch.tensor([2, 0, 3], device=dev), torch.tensor([max_len - 5, 1, max_len // 3], device=dev)
    runs = []
    split_len = da.split_length(3 * kv_heads, max_len, 64)
    assert da.reads_early(da.DEFAULT_LAUNCH, split_len, 64)
    assert da.reads_early(da.Launch(early=2), split_len, 64) == (max_len == 4000)
    for launch in ("0:4:2:0", "0:4:2:1", "0:4:2:2"):
        monkeypatch.setenv("POCKETLAB_ATTN_LAUNCH", launch)
        k_cache, v_cache = (c.clone() for c in caches)
        out = da.decode_attention(q, k_new, v_new, k_cache, v_cache, slots, lengths, max_len, dim**-0.5, (cos, sin),
                                  norms)  # fmt: skip
        runs.append((out, k_cache, v_cache))
    assert all(torch.equal(first, other) for first, *rest in zip(*runs, strict=True) for other in rest)


@pytest.mark.parametrize("programs,max_len", [(1, 128), (8, 4096), (256, 4096), (2048, 64), (1, 10**6)])
def test_splits_are_whole_blocks_and_few(programs, max_len):
    split = da.split_length(programs, max_len, 64)
    splits = -(-max_len // split)
    assert split % 64 == 0 and splits <= 64 and (splits == 1 or programs * (splits - 1) < 256)


def test_the_sweeps_columns_carry_a_launch_and_its_program_count():
    from pocketlab.layers.decode_attention_sweep import columns

    assert columns("256:8:1:1@8,32:4:2:1") == [
        ("256:8:1:1@8", 8, da.Launch(256, 8, 1, 1)),
        ("32:4:2:1", da.PROGRAMS_WANTED, da.Launch(32, 4, 2, 1)),
    ]


def test_the_programs_switch_sets_the_split_count(monkeypatch):
    """POCKETLAB_ATTN_PROGRAMS (for tools.ab) stands in for PROGRAMS_WANTED: 4 programs over 4,096 keys split 64
    ways by default, 4 ways when 16 programs are wanted."""
    assert da.split_length(4, 4096, 64) == 64
    monkeypatch.setenv("POCKETLAB_ATTN_PROGRAMS", "16")
    assert da.split_length(4, 4096, 64) == 1024


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3_5"])  # Qwen3.5: its output gate in the merge
def test_engine_decodes_the_same_with_either_attention(make_engine, preset):
    from conftest import LOGIT_TOL, greedy_run, random_prompt

    runs = {}
    for kind in ("triton", "sdpa"):
        engine = make_engine(preset, decode_attention=kind)
        runs[kind] = greedy_run(engine, random_prompt(20, seed=1), 12)
    assert runs["triton"][0] == runs["sdpa"][0]
    scale = runs["sdpa"][1].abs().max().item() if runs["sdpa"][1].dtype != torch.float32 else 1.0
    assert (runs["triton"][1] - runs["sdpa"][1]).abs().max() <= LOGIT_TOL * scale
