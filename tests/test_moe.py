"""Mixture of experts (Qwen3-MoE, Qwen3.5-MoE): float32 parity with HF transformers from the folders it writes
(per-expert tensor names, as on the hub) and from the stacked and multimodal layouts, HF's routing (ties included),
the fused Triton experts against the torch path (Triton's interpreter on the CPU), and the engine's guarantees
(batch == solo, padding rows, snapshots, prefix reuse, MTP speculation) on the MoE presets."""

import json
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import DEVICE, DTYPE, KERNELS, LOGIT_TOL, greedy_run, random_prompt
from safetensors.torch import load_file, save_file
from test_parity import assert_matches_reference, check_parity, hf_incremental_logits

from pocketlab import BatchedRequest, EngineOptions, ModelConfig, QwenEngine
from pocketlab.layers import moe
from pocketlab.layers.activations import swiglu
from pocketlab.layers.gated_delta import backend_name
from pocketlab.verify import mtp_runs
from pocketlab.verify.drafters import OracleDrafter

MOE_PRESETS = ["tiny-qwen3_moe", "tiny-qwen3_5_moe"]
# HF's float32 Qwen3.5 runs fla's TF32 chunk kernels where fla is installed (CUDA): its logits are no 1e-4 reference
HF_HYBRID_EXACT = not (DTYPE == "float32" and backend_name(DEVICE) == "fla")
INTERPRETER = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not INTERPRETER, reason="needs a GPU or TRITON_INTERPRET=1")


def engine(path, **options):
    opts = dict(max_slots=4, max_seq_len=256, prefill_chunk=16, device=DEVICE, dtype=DTYPE) | KERNELS | options
    return QwenEngine.from_pretrained(path, EngineOptions(**opts))


def close(a, b):
    tol = LOGIT_TOL * (1 if DTYPE == "float32" else b.abs().max().item())
    return (a.float() - b.float()).abs().max().item() <= tol


# -- parity with HF ------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", MOE_PRESETS)
@pytest.mark.parametrize("length", [15, 16, 17, 40])
def test_moe_parity_with_hf(preset, length, make_engine, checkpoint):
    """Prompts below, at and above the 16-token prefill chunk; greedy tokens and logits against HF's decode."""
    if "qwen3_5" in preset and not HF_HYBRID_EXACT:
        pytest.skip("HF's float32 Qwen3.5-MoE runs fla's TF32 kernels here; the 1e-4 check runs on the CPU")
    diff = check_parity(make_engine(preset, prefill_chunk=16), checkpoint(preset), length, steps=12)
    print(f"{preset} prompt={length}: max |diff| = {diff:.2e}")


def test_layers_are_sparse_where_hf_makes_them(checkpoint, make_engine):
    """mlp_only_layers=[1]: layer 1 dense; decoder_sparse_step=2 without it: only odd layers sparse, and
    norm_topk_prob=False (HF's default) keeps the raw softmax weights; both match HF."""
    eng = make_engine("tiny-qwen3_moe")
    assert [type(layer.mlp).__name__ for layer in eng.model.layers] == ["SparseMoE", "MLP", "SparseMoE"]
    path = checkpoint("tiny-qwen3_moe", decoder_sparse_step=2, mlp_only_layers=None, norm_topk_prob=False)
    eng = engine(path)
    assert [type(layer.mlp).__name__ for layer in eng.model.layers] == ["MLP", "SparseMoE", "MLP"]
    assert not eng.model.layers[1].mlp.renormalize
    check_parity(eng, path, 17, steps=8)
    assert all(type(layer.mlp).__name__ == "SparseMoE" for layer in make_engine("tiny-qwen3_5_moe").model.layers)


def test_checkpoints_name_experts_one_by_one(checkpoint):
    """What transformers 5.x writes (and the hub holds): mlp.experts.{e}.gate_proj/up_proj/down_proj, mlp.gate,
    mlp.shared_expert.*, mlp.shared_expert_gate; config.json spells num_experts `num_local_experts`."""
    path = checkpoint("tiny-qwen3_5_moe")
    names = set(load_file(path / "model.safetensors"))
    p = "model.layers.0.mlp."
    assert {p + f"experts.{e}.{n}_proj.weight" for e in range(8) for n in ("gate", "up", "down")} <= names
    assert {p + "gate.weight", p + "shared_expert_gate.weight", p + "shared_expert.down_proj.weight"} <= names
    raw = json.loads((checkpoint("tiny-qwen3_moe") / "config.json").read_text())
    assert raw.get("num_local_experts") == 8 and ModelConfig.from_dict(raw).num_experts == 8


def rewrite(src, dst, rename=lambda n: n, stack=False, config=None):
    """A copy of checkpoint folder src with tensors renamed / experts stacked (transformers' in-memory layout)."""
    from pocketlab.loader import stack_experts

    dst.mkdir()
    w = load_file(src / "model.safetensors")
    if stack:
        w = stack_experts(w)
    save_file({rename(n): t.contiguous() for n, t in w.items()}, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(config or json.loads((src / "config.json").read_text())))
    return dst


@pytest.mark.parametrize("layout", ["stacked experts", "multimodal", "multimodal stacked", "sharded"])
def test_other_layouts_load_the_same_model(layout, checkpoint, tmp_path):
    """Stacked experts (a transformers state_dict: experts.gate_up_proj [E, 2I, d], experts.down_proj [E, d, I])
    Qwen3.5-MoE's multimodal layout (model_type qwen3_5_moe, text_config, model.language_model.*) and a sharded
    folder give the per-expert text checkpoint's tokens and logits."""
    src = checkpoint("tiny-qwen3_5_moe")
    cfg = json.loads((src / "config.json").read_text())
    kwargs = dict(stack="stacked" in layout)
    if "multimodal" in layout:
        kwargs["rename"] = lambda n: n.replace("model.", "model.language_model.", 1) if n.startswith("model.") else n
        kwargs["config"] = dict(model_type="qwen3_5_moe", text_config=cfg, tie_word_embeddings=False)
    if layout == "sharded":  # experts of one layer across shards, listed in model.safetensors.index.json
        from pocketlab.tools.synthetic import write_checkpoint

        path = write_checkpoint("tiny-qwen3_5_moe", tmp_path / "variant", seed=0, max_shard_size="100KB")
        assert len(list(path.glob("model-*.safetensors"))) > 2
    else:
        path = rewrite(src, tmp_path / "variant", **kwargs)
    prompt = random_prompt(20, seed=2)
    want = greedy_run(engine(src), prompt, 5)
    got = greedy_run(engine(path), prompt, 5)
    assert got[0] == want[0] and close(got[1], want[1])  # same weights; the bits may follow their alignment
    if layout == "stacked experts" and HF_HYBRID_EXACT:  # HF reads this layout too, to the same logits
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        assert_matches_reference(hf_incremental_logits(hf, prompt, got[0][:-1]), got[1], got[0])


def with_weights(src, dst, w):
    """Checkpoint folder dst: src's config.json with the tensors w."""
    dst.mkdir()
    save_file(w, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


def test_mtp_experts_stacked_beside_per_expert_layers(checkpoint, tmp_path):
    """Some Qwen3.5-MoE packs fuse the MTP layer's experts (mtp.layers.0.mlp.experts.gate_up_proj / down_proj)
    while the main layers keep per-expert names: each block is read in its own layout."""
    src = checkpoint("tiny-qwen3_5_moe-mtp")
    from pocketlab.loader import stack_experts

    w = load_file(src / "model.safetensors")
    mtp = stack_experts({n: t for n, t in w.items() if n.startswith("mtp.")})
    path = with_weights(src, tmp_path / "mixed", {n: t for n, t in w.items() if not n.startswith("mtp.")} | mtp)
    assert "mtp.layers.0.mlp.experts.gate_up_proj" in load_file(path / "model.safetensors")
    a, b = (engine(p, speculative_tokens=1).model.mtp.layer.mlp for p in (src, path))
    assert torch.equal(a.gate_up, b.gate_up) and torch.equal(a.down, b.down) and torch.equal(a.router, b.router)


def test_routing_ties_follow_hf(checkpoint, tmp_path):
    """A zero router: all experts tie for every token, and torch.topk's order picks them in HF and here alike
    (the choice matters: the same tie over the experts in reverse order gives other logits)."""
    src = checkpoint("tiny-qwen3_moe")
    w = load_file(src / "model.safetensors")
    w["model.layers.0.mlp.gate.weight"].zero_()
    path = with_weights(src, tmp_path / "ties", w)
    check_parity(engine(path), path, 17, steps=8)
    p = "model.layers.0.mlp.experts."
    names = [(e, n) for e in range(8) for n in ("gate", "up", "down")]
    w |= {f"{p}{e}.{n}_proj.weight": w[f"{p}{7 - e}.{n}_proj.weight"] for e, n in names}
    reversed_path = with_weights(src, tmp_path / "reversed", w)
    prompt = random_prompt(9, seed=1)
    assert not close(greedy_run(engine(path), prompt, 0)[1], greedy_run(engine(reversed_path), prompt, 0)[1])


# -- bad input -----------------------------------------------------------------------------------
def test_bad_moe_configs_are_refused(checkpoint, tmp_path):
    raw = json.loads((checkpoint("tiny-qwen3_moe") / "config.json").read_text())
    with pytest.raises(ValueError, match="num_experts_per_tok=9 with num_experts=8"):
        ModelConfig.from_dict(raw | dict(num_experts_per_tok=9))
    with pytest.raises(ValueError, match="moe_kernel"):
        EngineOptions(moe_kernel="cutlass")
    w = load_file(checkpoint("tiny-qwen3_moe") / "model.safetensors")
    del w["model.layers.2.mlp.experts.5.up_proj.weight"]
    path = rewrite(checkpoint("tiny-qwen3_moe"), tmp_path / "missing")
    save_file(w, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"expert 5 of 8 lacks \['up_proj'\]"):
        engine(path)


# -- the experts: torch paths and the Triton kernels ---------------------------------------------
def expert_inputs(N, E=8, H=72, I=40, k=3, seed=0, dtype=torch.float32):
    """Off-tile sizes (H, I not multiples of the blocks) and k = 3, on the test device."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g)
    gate_up = torch.randn(E, 2 * I, H, generator=g) * H**-0.5
    down = torch.randn(E, H, I, generator=g) * I**-0.5
    weights, ids = moe.route(torch.randn(N, E, generator=g) * 2, k, renormalize=False)
    return [t.to(DEVICE, dtype) if t.is_floating_point() else t.to(DEVICE) for t in (x, gate_up, down, weights, ids)]


def test_grouped_experts_equal_the_loop():
    for N in (1, 6, 33):
        args = expert_inputs(N, seed=N)
        torch.testing.assert_close(moe.grouped_experts(*args), moe.looped_experts(*args), atol=1e-5, rtol=1e-5)
    args = expert_inputs(5, H=70)  # rows grouped_mm cannot take (not 16-byte multiples): the loop's result
    assert not moe.grouped_mm_fits(*args[:3]) and torch.equal(moe.grouped_experts(*args), moe.looped_experts(*args))


@needs_triton
@pytest.mark.parametrize("N", [1, 5, 64])
def test_fused_experts_equal_the_torch_path(N):
    """The Triton kernels (gate_up + SiLU*mul, down * routing weight, k-ordered sum) against the reference loop:
    experts idle (N=1), in one partial block (N=5), over several blocks with a partial last one (N=64)."""
    from pocketlab.layers.moe_kernel import fused_experts, tiles

    args = expert_inputs(N, H=70, seed=N)
    counts, block = torch.bincount(args[4].flatten(), minlength=8), tiles(3 * N, torch.float32, args[0].device).block_m
    assert {1: (counts == 0).any(), 5: (counts < block).all(), 64: (counts > block).any()}[N]
    torch.testing.assert_close(fused_experts(*args), moe.looped_experts(*args), atol=2e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("parts", ["residual", "shared", "both"])
def test_fused_experts_add_the_shared_expert_and_residual_as_torch(parts):
    """The k-sum's launch also adds the gated shared expert (one gate per token, a column of the router's logits)
    and the residual stream: as moe.combine's torch ops do after the reference loop."""
    from pocketlab.layers.moe_kernel import fused_experts

    args = expert_inputs(6, H=70, seed=2)
    g = torch.Generator().manual_seed(9)
    residual, shared, logits = (torch.randn(6, n, generator=g).to(DEVICE) for n in (70, 70, 9))
    extra = dict(residual=residual) if parts != "shared" else {}
    extra |= dict(shared=shared, shared_gate=logits[:, 8:]) if parts != "residual" else {}
    torch.testing.assert_close(fused_experts(*args, **extra), moe.looped_experts(*args, **extra), atol=2e-5, rtol=1e-5)


@needs_triton
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the huge rows' SiLU, in the interpreter
def test_fused_experts_rows_do_not_depend_on_the_batch():
    """A token's output is the same bits alone, among others, and beside garbage rows (huge or NaN inputs)."""
    from pocketlab.layers.moe_kernel import fused_experts

    x, gu, d, w, ids = expert_inputs(9, seed=4)
    full = fused_experts(x, gu, d, w, ids)
    for i in (0, 4, 8):
        alone = fused_experts(x[i : i + 1], gu, d, w[i : i + 1], ids[i : i + 1])
        assert torch.equal(alone[0], full[i])
    junk = torch.cat([x, torch.full_like(x[:3], float("nan")), x[:3] * 1e4])
    jw, jids = torch.cat([w, w[:3], w[:3]]), torch.cat([ids, ids.flip(0)[:3], ids[:3]])
    assert torch.equal(fused_experts(junk, gu, d, jw, jids)[:9], full)


@needs_triton
@pytest.mark.parametrize("offset", [False, True], ids=["w*x", "(1+w)*x"])
def test_gemv_experts_equal_the_torch_path(offset):
    """Decode's few tokens through layers.moe_gemv (each program streams rows of all k experts, the block's RMSNorm in
    the gate_up launch; the k products, gated shared expert and residual added in the down launch)
    against the reference loop on the float32 norm of x, at 1-4 tokens and with each part left out; the shared
    expert given as an output or as weights run in the same launches. Rows of very different scales and a large
    eps, so a norm over part of H, a lost routing weight or pair, or another token's shared row shows."""
    from pocketlab.layers.moe_gemv import gemv_experts
    from pocketlab.layers.norm import RMSNorm

    g = torch.Generator().manual_seed(11)
    for N in (1, 2, 4):
        x, gu, d, w, ids = expert_inputs(N, H=70, seed=20 + N)
        x = x * torch.logspace(-2, 1, N, device=DEVICE)[:, None]
        residual, shared, logits = (torch.randn(N, n, generator=g).to(DEVICE) for n in (70, 70, 9))
        everything = dict(shared=shared, shared_gate=logits[:, 8:], residual=residual)
        for norm in (None, RMSNorm(torch.randn(70, generator=g).to(DEVICE), 1e-2, offset)):
            normed = x if norm is None else norm(x)
            for extra in ({}, dict(residual=residual), everything):
                want = moe.looped_experts(normed, gu, d, w, ids, **extra)
                got = gemv_experts(x, gu, d, w, ids, norm=norm, **extra)
                torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
            # the shared expert's own weights (as wide as an expert) run in the same two launches
            shared_gu, shared_d = gu[N % 8] * 2, d[(N + 1) % 8] * 2  # unlike any routed pair's
            own = F.linear(swiglu(F.linear(normed, shared_gu)), shared_d)
            for extra in (dict(shared_gate=logits[:, 8:]), dict(shared_gate=logits[:, 8:], residual=residual)):
                want = moe.looped_experts(normed, gu, d, w, ids, shared=own, **extra)
                got = gemv_experts(x, gu, d, w, ids, norm=norm, shared_weights=(shared_gu, shared_d), **extra)
                torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="not as wide as an expert"):
        gemv_experts(x, gu, d, w, ids, shared_gate=logits[:, 8:], shared_weights=(gu[0, :8], d[0]))


@needs_triton
@pytest.mark.parametrize("offset", [False, True], ids=["w*x", "(1+w)*x"])
def test_tma_ring_experts_equal_the_torch_path(offset):
    """The TMA-ring experiment's experts (layers.moe_gemv_tma: gate_up per pair and columns through the ring, then
    moe_gemv's own down) against the reference loop on the float32 norm of x: 1-3 tokens, column blocks past I (their
    rows belong to the up half or the next expert), with the residual and the gated shared expert, given as an
    output or as weights run in the same launches."""
    from pocketlab.layers.gemv_tma import Ring
    from pocketlab.layers.moe_gemv_tma import experts_tma
    from pocketlab.layers.norm import RMSNorm

    ring = Ring(16, 32, 2)
    g = torch.Generator().manual_seed(12)
    for N in (1, 3):
        x, gu, d, w, ids = expert_inputs(N, seed=40 + N)
        x = x * torch.logspace(-2, 1, N, device=DEVICE)[:, None]
        residual, shared, gate = (torch.randn(N, n, generator=g).to(DEVICE) for n in (72, 72, 1))
        for norm in (None, RMSNorm(torch.randn(72, generator=g).to(DEVICE), 1e-2, offset)):
            normed = x if norm is None else norm(x)
            for extra in ({}, dict(residual=residual, shared=shared, shared_gate=gate)):
                want = moe.looped_experts(normed, gu, d, w, ids, **extra)
                got = experts_tma(x, gu, d, w, ids, **extra, norm=norm, ring=ring)
                torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
            shared_gu, shared_d = gu[N % 8] * 2, d[(N + 1) % 8] * 2  # unlike any routed pair's
            own = F.linear(swiglu(F.linear(normed, shared_gu)), shared_d)
            want = moe.looped_experts(normed, gu, d, w, ids, shared=own, shared_gate=gate, residual=residual)
            got = experts_tma(x, gu, d, w, ids, residual, None, gate, norm, shared_weights=(shared_gu, shared_d),
                              ring=ring)  # fmt: skip
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@needs_triton
def test_align_in_one_launch_gives_the_torch_layout():
    """The one-program align (histogram, sort, scans) lays the pairs out exactly as the torch ops do: experts
    idle, in one partial block, over several blocks; one pair alone; the most pairs it takes."""
    from pocketlab.layers.moe_kernel import ALIGN_MAX_PAIRS, align, align_in_one_launch

    gen = torch.Generator().manual_seed(3)
    cases = [(torch.randint(0, 8, (N, 3), generator=gen), 8, 4) for N in (1, 5, 40)]
    skewed = torch.where(torch.rand(64, 8, generator=gen) < 0.7, 2, torch.randint(0, 128, (64, 8), generator=gen))
    cases += [(torch.zeros(1, 1, dtype=torch.int64), 4, 16), (skewed, 128, 16)]
    cases += [(torch.randint(0, 60, (ALIGN_MAX_PAIRS // 8, 8), generator=gen), 60, 16)]
    for ids, E, block in cases:
        ids = ids.to(DEVICE)
        for want, got in zip(align(ids, E, block), align_in_one_launch(ids, E, block), strict=True):
            assert torch.equal(got, want), (tuple(ids.shape), E, block)
    with pytest.raises(ValueError, match="pairs"):
        align_in_one_launch(torch.zeros(ALIGN_MAX_PAIRS + 1, 1, dtype=torch.int64, device=DEVICE), 4, 16)


@needs_triton
@pytest.mark.parametrize("renormalize", [False, True])
def test_route_in_one_launch_equals_torch_route(renormalize):
    """The one-launch routing (softmax, top-k, rescale) against moe.route, from logits that are a column slice (the
    shared expert's gate beside them), for 8-256 experts: the same experts in the same order and the same weights.
    Where experts tie it takes the lowest first: so does torch.topk where a whole row ties on CUDA (a zero router:
    test_routing_ties_follow_hf), not always at other ties (seen in bf16 on the H200), where any of the equal
    experts is a right answer; on the CPU torch orders ties its own way, so the engine routes there by torch."""
    from pocketlab.layers.moe_kernel import route_in_one_launch

    gen = torch.Generator().manual_seed(7)
    cases = [(torch.randn(N, E + 1, generator=gen) * 3, k) for N, E, k in ((1, 8, 3), (13, 128, 8), (6, 256, 8))]
    ties = [(torch.randn(64, 129, generator=gen).bfloat16(), 8), (torch.randint(0, 3, (64, 129), generator=gen), 8)]
    for n, (logits, k) in enumerate(cases + ties):
        logits = logits.to(DEVICE, logits.dtype if logits.is_floating_point() else torch.float32)[:, :-1]
        (want_w, want_ids), (got_w, got_ids) = (
            moe.route(logits, k, renormalize),
            route_in_one_launch(logits, k, renormalize),
        )
        torch.testing.assert_close(got_w, want_w)  # the dtype's tolerance: bf16 rounds the float32 weights
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        assert torch.equal(probs.gather(1, got_ids), probs.gather(1, want_ids)), (tuple(logits.shape), k)
        assert (got_ids.sort(dim=1).values.diff(dim=1) > 0).all()  # k distinct experts
        if n < len(cases):  # no ties: the very same ids
            assert torch.equal(got_ids, want_ids)
    lowest_first = route_in_one_launch(torch.zeros(3, 16, device=DEVICE), 8, renormalize)[1]
    assert torch.equal(lowest_first, torch.arange(8, device=DEVICE).expand(3, 8))
    with pytest.raises(ValueError, match="top_k must be in 1..8"):
        route_in_one_launch(torch.zeros(2, 8, device=DEVICE), 9, False)


def test_padding_rows_do_not_touch_real_tokens():
    """The torch path too: rows of garbage (NaN, huge) beside real tokens leave the real rows' outputs alone."""
    x, gu, d, w, ids = expert_inputs(7, seed=5)
    want = moe.grouped_experts(x, gu, d, w, ids)
    junk = torch.cat([x, torch.full_like(x[:2], float("nan"))])
    got = moe.grouped_experts(junk, gu, d, torch.cat([w, w[:2]]), torch.cat([ids, ids[:2]]))
    torch.testing.assert_close(got[:7], want, atol=1e-6, rtol=0)
    assert got[7:].isnan().all()


@needs_triton
@pytest.mark.parametrize("fused_linear, shared_width", [("torch", 32), ("triton", 32), ("triton", 48)])
def test_engine_with_the_triton_experts_matches_the_torch_path(fused_linear, shared_width, checkpoint, monkeypatch):
    """The Triton experts in the engine; with the fused linears, decode's one token takes layers.moe_gemv (the
    norm folded into the router, shared expert and experts) and prefill the block kernels. A shared expert as wide
    as a routed one (32) runs inside moe_gemv's launches; another width keeps its own GEMVs, and then the routing
    ran two launches before the experts (ids_ready)."""
    from pocketlab.layers import moe_gemv

    real, calls = moe_gemv.gemv_experts, []

    def counted(x, *args, **kwargs):
        calls.append((x.shape[0], kwargs.get("shared_weights") is not None, kwargs.get("ids_ready", False)))
        return real(x, *args, **kwargs)

    monkeypatch.setattr(moe_gemv, "gemv_experts", counted)
    path = checkpoint("tiny-qwen3_5_moe", **({"shared_expert_intermediate_size": 48} if shared_width == 48 else {}))
    prompt = random_prompt(20, seed=3)
    want = greedy_run(engine(path, moe_kernel="torch"), prompt, 4)
    eng = engine(path, moe_kernel="triton", fused_linear=fused_linear)
    got = greedy_run(eng, prompt, 4)
    assert got[0] == want[0] and close(got[1], want[1])
    if fused_linear == "triton":  # every layer of a decode step (CUDA graph replays run no Python: fewer there)
        inside = shared_width == 32
        assert set(calls) == {(1, inside, not inside)} and len(calls) >= eng.cfg.num_hidden_layers
    else:
        assert calls == []


@needs_triton
@pytest.mark.parametrize("shared_width", [32, 48])
def test_engine_with_the_tma_ring_experts_matches_the_torch_path(shared_width, checkpoint, monkeypatch):
    """POCKETLAB_MOE_TMA sends decode's experts' gate_up through layers.moe_gemv_tma's ring (the norm, and a shared
    expert as wide as a routed one, inside; a wider one as an output added in the down): the torch path's greedy
    tokens and logits, every decode layer through the ring."""
    from pocketlab.layers import moe_gemv_tma

    calls = []
    real = moe_gemv_tma.gate_up_tma
    monkeypatch.setattr(moe_gemv_tma, "gate_up_tma", lambda *a, **k: calls.append("gate_up_tma") or real(*a, **k))
    monkeypatch.setenv("POCKETLAB_MOE_TMA", "8:32:2")
    path = checkpoint("tiny-qwen3_5_moe", **({"shared_expert_intermediate_size": 48} if shared_width == 48 else {}))
    prompt = random_prompt(20, seed=3)
    want = greedy_run(engine(path, moe_kernel="torch"), prompt, 4)
    eng = engine(path, moe_kernel="triton", fused_linear="triton")
    got = greedy_run(eng, prompt, 4)
    assert got[0] == want[0] and close(got[1], want[1])
    assert len(calls) >= eng.cfg.num_hidden_layers


def test_an_engine_whose_experts_sync_with_the_host_captures_no_graph(checkpoint, monkeypatch):
    """The torch experts path where grouped_mm cannot run (float32 on CUDA) loops over experts on the host: the
    engine turns its graphs off up front with one warning, instead of failing every shape's capture twice."""
    path = checkpoint("tiny-qwen3_moe")
    syncs = DEVICE == "cuda" and DTYPE == "float32"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eng = engine(path, moe_kernel="torch")
    assert eng.model.syncs_with_host == syncs
    assert [str(w.message).startswith("CUDA graphs off") for w in caught].count(True) == int(syncs)
    if DEVICE == "cuda":
        assert (eng.graphs is None) == syncs and not (eng.graphs and eng.graphs.failed)
    monkeypatch.setattr(moe, "grouped_mm_fits", lambda *args: False)  # rows it cannot take: the loop
    assert eng.model.syncs_with_host


# -- engine guarantees on the MoE presets ---------------------------------------------------------
@pytest.mark.parametrize("preset", MOE_PRESETS)
def test_batch_api_equals_solo_runs(preset, make_engine):
    eng = make_engine(preset)
    prompts = [random_prompt(n, seed=40 + n) for n in (1, 6, 21, 9)]  # ragged, one over the 16-token chunk
    solo = []
    for p in prompts:
        eng.reset()
        solo.append(greedy_run(eng, p, 6))
    eng.reset()
    reqs = [BatchedRequest(request_id=i, prompt_tokens=p) for i, p in enumerate(prompts)]
    logits = [[r.logits] for r in eng.batch_prefill(reqs).results]
    for _ in range(6):
        out = eng.batch_decode_step(reqs)
        for i in range(len(reqs)):
            logits[i].append(out.logits[i])
    for i, r in enumerate(reqs):
        assert r.generated_tokens == solo[i][0]
        assert close(torch.stack(logits[i]), solo[i][1])


def test_snapshot_restore_and_prefix_reuse(make_engine):
    eng = make_engine("tiny-qwen3_5_moe", checkpoint_stride=8, prefix_block=4)
    prompt = random_prompt(30, seed=7)
    r = eng.prefill(prompt, slot_id=1)
    snap = eng.snapshot(1)
    want = [eng.decode_step(r.next_token, slot_id=1).logits for _ in range(1)]
    eng.release_slot(1)
    eng.prefill(random_prompt(5, seed=8), slot_id=1)  # other traffic in the snapshot's slot
    eng.restore(snap, slot_id=2)
    got = [eng.decode_step(r.next_token, slot_id=2).logits]
    assert torch.equal(got[0], want[0])
    cold = make_engine("tiny-qwen3_5_moe", prefix_cache=False)
    longer = prompt[:24] + random_prompt(6, seed=9)
    hit = eng.prefill(longer, slot_id=3)
    assert hit.reused_tokens >= 16
    ref = cold.prefill(longer, slot_id=0)
    assert hit.next_token == ref.next_token and close(hit.logits, ref.logits)


def test_mtp_head_is_an_moe_layer_and_speculation_is_exact(checkpoint):
    """Qwen3.5-MoE's MTP layer is sparse (mtp.layers.0.mlp.experts.{e}.*, router, gated shared expert, as vLLM
    builds it); greedy decoding with its drafts (and with half-right ones, so drafts get accepted) is plain's."""
    path = checkpoint("tiny-qwen3_5_moe-mtp")
    assert "mtp.layers.0.mlp.experts.3.down_proj.weight" in load_file(path / "model.safetensors")
    prompts = [random_prompt(5, seed=31), random_prompt(12, seed=32)]
    reference = mtp_runs.plain_greedy(engine(path, max_slots=2), prompts, 24)
    for name in ("mtp", "half"):
        eng = engine(path, max_slots=2, speculative_tokens=2, max_seq_len=96)
        assert type(eng.model.mtp.layer.mlp).__name__ == "SparseMoE"
        if name == "half":
            eng.speculator.use(OracleDrafter(dict(enumerate(reference)), accuracy=0.5, seed=3))
        reqs, _ = mtp_runs.interleaved(eng, prompts, 20)
        for r, ref in zip(reqs, reference, strict=True):
            assert r.generated_tokens[:21] == ref[len(r.prompt_tokens) :][:21]
        if name == "half":
            assert eng.speculator.stats.accepted > 0


# -- the bench's roofline ------------------------------------------------------------------------
def test_roofline_counts_the_experts_a_step_reads(tmp_path):
    """Decode bytes = always-read weights + the routed experts picked (counted from the step's own routing, between
    k and E per MoE layer) + K/V + state; the uniform-routing expectation E * (1 - (1 - k/E)^B) per layer."""
    from test_bench import ARGS

    from pocketlab.tools import bench
    from pocketlab.tools.roofline import ModelCost
    from pocketlab.tools.synthetic import hf_config

    cost = ModelCost.of(ModelConfig.from_dict(hf_config("qwen3-30b-a3b").to_dict()), 2)
    assert cost.expert_bytes == 3 * 768 * 2048 * 2 and cost.moe_layers == 48
    assert cost.expected_experts(1) == pytest.approx(48 * 8) and cost.expected_experts(10**4) == pytest.approx(48 * 128)
    assert cost.decode_bytes([0], experts_read=100)["expert_bytes"] == 100 * cost.expert_bytes
    args = [a if a != "tiny-qwen3" else "tiny-qwen3_5_moe" for a in ARGS]
    args += ["--no-peer", "--batch-sizes", "1,4", "--out", str(tmp_path / "b.json")]
    result = bench.main(args)
    assert result["meta"]["hf_experts_implementation"] in ("grouped_mm", "batched_mm", "eager")
    for d in result["decode"]:
        layers = 4  # every Qwen3.5-MoE layer is sparse: 8 experts, top-2
        assert 2 * layers <= d["experts_read"] <= min(8, 2 * d["batch"]) * layers
        assert d["total_bytes"] == d["weight_bytes"] + d["expert_bytes"] + d["kv_bytes"] + d["state_bytes"]


# -- the real MoE shapes on one GPU ----------------------------------------------------------------
def assert_reads_hf_tensors_in_place(eng: QwenEngine, hf) -> None:
    """The engine's routed experts, embedding and lm_head are HF's own tensors (same memory), not copies."""
    params = dict(hf.named_parameters())
    held = {"model.embed_tokens.weight": eng.model.embed, "lm_head.weight": eng.model.lm_head}
    for i, layer in enumerate(eng.model.layers):
        if isinstance(layer.mlp, moe.SparseMoE):
            p = f"model.layers.{i}.mlp.experts."
            held |= {p + "gate_up_proj": layer.mlp.gate_up, p + "down_proj": layer.mlp.down}
    assert any(".experts." in n for n in held)
    copied = [n for n, t in held.items() if t.data_ptr() != params[n].data_ptr()]
    assert not copied, f"the engine copied {copied[:3]}: at Qwen3-30B-A3B two copies of the experts outgrow one H200"


@pytest.mark.parametrize("preset", MOE_PRESETS)
def test_bench_engine_runs_on_hfs_own_experts(preset):
    """bench's build(): HF's random-weight model and the engine over the very same expert tensors, so the weights are
    on the GPU once (Qwen3-30B-A3B: 57 GiB of bf16 weights, 54 of them experts; twice would not fit with its K/V)."""
    from pocketlab.tools.bench import BenchConfig
    from pocketlab.tools.bench_engine import build

    cfg = BenchConfig(
        model=preset,
        device=DEVICE,
        dtype=DTYPE,
        batch_sizes=(1,),
        latency_batch_sizes=(1,),
        prompt_lens=(16,),
        new_tokens=2,
        decode_prompt=8,
        ragged=1,
        latency_steps=0,
        serving_prompt=(1, 1),
        serving_new=(1, 1),
    )
    hf, eng = build(cfg)
    assert_reads_hf_tensors_in_place(eng, hf)


def test_notebook_pair_of_a_real_shape_preset_shares_hfs_experts(monkeypatch):
    """verify.load_pair builds a real-shape preset in memory (no checkpoint folder) and its engines over HF's tensors:
    exercised here through a tiny MoE shape under a real-shape (not tiny-) name."""
    from pocketlab.tools import synthetic
    from pocketlab.verify.common import load_pair

    monkeypatch.setitem(synthetic.PRESETS, "moe-shape-under-test", synthetic.PRESETS["tiny-qwen3_5_moe"])
    pair = load_pair("moe-shape-under-test", DEVICE, DTYPE)
    assert_reads_hf_tensors_in_place(pair.engine(max_slots=1, max_seq_len=64), pair.hf)


@pytest.mark.parametrize(
    "short, full, experts_gate_up",
    [
        ("qwen3-30b-a3b-4-layers", "qwen3-30b-a3b", (128, 2 * 768, 2048)),
        ("qwen3.5-35b-a3b-4-layers", "qwen3.5-35b-a3b", (256, 2 * 512, 2048)),
    ],
)
def test_notebook_moe_presets_are_the_real_model_cut_to_4_layers(short, full, experts_gate_up):
    """The notebooks' MoE presets: HF's config of the real-shape preset but for the layer count, so every tensor has
    the real model's shape (the experts' spelled out: Qwen3-30B-A3B 128 x 768, Qwen3.5-35B-A3B 256 x 512, hidden
    2,048), the first 4 layers of its kinds (Qwen3.5: 3 linear + 1 full attention); and HF's model of it (built on
    the meta device: no memory) holds exactly the tensors the engine expects."""
    import re

    from pocketlab.loader import expected_shapes, stack_experts, validate_weights
    from pocketlab.tools.synthetic import build_hf_model, hf_config

    a, b = hf_config(short).to_dict(), hf_config(full).to_dict()
    assert {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)} <= {"num_hidden_layers", "layer_types"}
    cut, whole = ModelConfig.from_dict(a), ModelConfig.from_dict(b)
    assert cut.num_hidden_layers == 4 < whole.num_hidden_layers
    assert cut.layer_types == whole.layer_types[:4] and set(cut.layer_types) == set(whole.layer_types)

    def layer(name: str) -> int:
        m = re.match(r"model\.layers\.(\d+)\.", name)
        return int(m[1]) if m else -1

    shapes = expected_shapes(cut)
    assert shapes == {n: s for n, s in expected_shapes(whole).items() if layer(n) < 4}
    assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == experts_gate_up
    hf = build_hf_model(short, device="meta", dtype=torch.bfloat16)
    validate_weights(stack_experts(dict(hf.state_dict())), ModelConfig.from_dict(hf.config.to_dict()), "meta")
