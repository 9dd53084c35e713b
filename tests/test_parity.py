"""Engine vs HF transformers from the same checkpoint folder: logits and greedy tokens.

The reference is HF's own serving path: prefill the prompt, then decode token by token with its cache.
(For Qwen3.5, HF's chunked and recurrent delta-rule paths differ from each other by ~1e-4 in float32;
its incremental path is the one that decodes, and we match it to ~3e-5.)
"""

import os

import pytest
import torch
import transformers
from conftest import DEVICE, DTYPE, LOGIT_TOL, greedy_run, random_prompt

from pocketlab import EngineOptions, SamplingParams
from pocketlab.layers import gemv_tma
from pocketlab.layers.gated_delta import backend_name
from pocketlab.requests import BatchedRequest

RING = DEVICE == "cuda" and gemv_tma.has_tma(torch.device(DEVICE))  # few-row matmuls take the TMA ring (sm_90)
NORM_NOISE = 0.2  # HF starts every RMSNorm as the identity: checkpoints whose norm weights are not, so a lost one shows


def hf_reference(path):
    # In low precision the reference is HF in float32 on the same device: we measure our error, not theirs.
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEVICE).eval()


@torch.no_grad()
def hf_incremental_logits(hf, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """HF logits after the prompt and after each continuation token, decoding with its cache."""
    out = hf(torch.tensor([prompt], device=DEVICE), use_cache=True)
    logits = [out.logits[0, -1]]
    for t in continuation:
        out = hf(torch.tensor([[t]], device=DEVICE), past_key_values=out.past_key_values, use_cache=True)
        logits.append(out.logits[0, -1])
    return torch.stack(logits).float()


def assert_matches_reference(ref_logits, ours, tokens, dtype=DTYPE, tol=LOGIT_TOL):
    """Logits within tolerance (16-bit: `tol` of the largest reference logit); greedy tokens identical wherever the
    reference is not a near-tie."""
    scale = 1.0 if dtype == "float32" else ref_logits.abs().max().item()
    diff = (ours.float().cpu() - ref_logits.cpu()).abs().max().item()
    assert diff <= tol * scale, f"max |logits diff| {diff:.3g} > {tol * scale:.3g}"
    top2 = ref_logits.topk(2, dim=-1).values
    decisive = (top2[:, 0] - top2[:, 1]) > 2 * tol * scale
    if dtype == "float32":
        assert decisive.all(), "random weights gave a near-tie; choose another seed"
    assert torch.equal(ref_logits.argmax(-1)[decisive].cpu(), torch.tensor(tokens)[decisive.cpu()])
    return diff


def check_parity(engine, path, length, steps=33):
    prompt = random_prompt(length, seed=length)
    tokens, logits = greedy_run(engine, prompt, steps)
    ref = hf_incremental_logits(hf_reference(path), prompt, tokens[:-1])
    return assert_matches_reference(ref, logits, tokens)


@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-qwen3"])
@pytest.mark.parametrize("length", [1, 15, 16, 17, 53])
def test_dense_parity_with_hf(preset, length, make_engine, checkpoint):
    diff = check_parity(make_engine(preset, prefill_chunk=16), checkpoint(preset), length)
    print(f"{preset} prompt={length}: max |diff| = {diff:.2e}")


@pytest.mark.parametrize("length", [1, 63, 64, 65, 200])
def test_hybrid_parity_with_hf(length, make_engine, checkpoint):
    if DTYPE == "float32" and backend_name(DEVICE) == "fla":
        pytest.skip("HF's float32 Qwen3.5 runs fla's TF32 chunk kernels on CUDA; the 1e-4 check runs on the CPU")
    engine = make_engine("tiny-qwen3_5", prefill_chunk=64, max_seq_len=320)
    diff = check_parity(engine, checkpoint("tiny-qwen3_5"), length)
    print(f"tiny-qwen3_5 prompt={length}: max |diff| = {diff:.2e}")


def test_dense_prefill_matches_hf_full_forward(make_engine, checkpoint):
    """Also against HF's cache-free forward over the whole sequence."""
    engine = make_engine("tiny-qwen3", prefill_chunk=16)
    prompt = random_prompt(40, seed=4)
    tokens, logits = greedy_run(engine, prompt, 20)
    with torch.no_grad():
        ref = hf_reference(checkpoint("tiny-qwen3"))(torch.tensor([prompt + tokens[:-1]], device=DEVICE)).logits
    assert_matches_reference(ref[0, 39:].float(), logits, tokens)


def test_tied_embeddings_parity(checkpoint):
    from pocketlab import EngineOptions, QwenEngine

    path = checkpoint("tiny-qwen3", tie_word_embeddings=True)
    engine = QwenEngine.from_pretrained(path, EngineOptions(device=DEVICE, dtype=DTYPE, max_seq_len=64))
    assert engine.model.lm_head is engine.model.embed
    check_parity(engine, path, 7, steps=8)


@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-qwen3", "tiny-qwen3_5"])
def test_parity_through_the_fused_linears(preset, make_engine, checkpoint):
    """The default CUDA engine's projections (layers.gemv at one row, each pre-norm inside the projection's launch;
    the fused matmul at few rows) on any device: Qwen2's biases, Qwen3's `w * x` and Qwen3.5's `(1 + w) * x`
    norms, the Gated DeltaNet decode step's conv in in_proj's epilogue and its gated norm in the state step (the
    in-place decode kernels on), a prompt's q/k norms, RoPE and K/V write in one row kernel. Through Triton's
    interpreter on the CPU."""
    if preset == "tiny-qwen3_5" and DTYPE == "float32" and backend_name(DEVICE) == "fla":
        pytest.skip("HF's float32 Qwen3.5 runs fla's TF32 chunk kernels on CUDA; the 1e-4 check runs on the CPU")
    pytest.importorskip("triton")
    engine = make_engine(preset, NORM_NOISE, fused_linear="triton", gemv_rows=1, linear_decode="triton")
    assert engine.model.kernels.linear.__name__ == "run"  # layers.linear.fused_at_few_rows
    diff = check_parity(engine, checkpoint(preset, norm_noise=NORM_NOISE), 17, steps=6)
    print(f"{preset} fused linears: max |diff| = {diff:.2e}")


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3_5"])
def test_parity_with_the_mlp_norm_weight_in_gate_up(preset, make_engine, checkpoint):
    """The MLP's pre-norm weight multiplied into gate_up at load (`fold_norm_weights`, "auto" where no GEMV takes
    the one-row call, as at 8B and 9B; here gemv_rows=0), the norm then a scalar a row inside the fused matmul's
    launch: HF's logits at every step, Qwen3's `w * x` and Qwen3.5's `(1 + w) * x` folded alike."""
    if preset == "tiny-qwen3_5" and DTYPE == "float32" and backend_name(DEVICE) == "fla":
        pytest.skip("HF's float32 Qwen3.5 runs fla's TF32 chunk kernels on CUDA; the 1e-4 check runs on the CPU")
    pytest.importorskip("triton")
    engine = make_engine(preset, NORM_NOISE, fused_linear="triton", gemv_rows=0, linear_decode="triton")
    assert all(layer.post_norm.unit for layer in engine.model.layers)
    diff = check_parity(engine, checkpoint(preset, norm_noise=NORM_NOISE), 17, steps=6)
    print(f"{preset} MLP norm weight in gate_up: max |diff| = {diff:.2e}")


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3_5", "tiny-qwen3_moe", "tiny-qwen3_5_moe"])
def test_parity_of_a_batch_whose_norms_read_the_row_squares_left_by_the_ring(preset, make_engine, checkpoint,
                                                                            monkeypatch):  # fmt: skip
    """Batches of 2-64 rows where few-row matmuls take the TMA ring (sm_90; switched in elsewhere): every pre-norm's
    weight in its projection (a MoE block's norm stays its own), each norm but the first a scalar a row from the sums
    of squares that the residual epilogue before it left. HF's logits for both slots of a batched decode, each
    against its own run, within 2% of the largest: in float16, whose rounding (not bf16's, 8x coarser) leaves room
    to see an error of ours."""
    pytest.importorskip("triton")
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the ring runs on a GPU or in Triton's interpreter")
    if not RING:
        monkeypatch.setenv("POCKETLAB_MATMUL_TMA", "64:3:0")
    engine = make_engine(preset, NORM_NOISE, fused_linear="triton", linear_decode="triton", dtype="float16")
    layers = engine.model.layers
    dense = [hasattr(layer.mlp, "normed_weight") for layer in layers]  # MoE blocks norm in their own kernels
    assert [(layer.input_norm.unit, layer.post_norm.unit) for layer in layers] == [(True, d) for d in dense]
    requests = [BatchedRequest(s, random_prompt(17 - 8 * s, seed=s), slot_id=s) for s in range(2)]
    logits = [[r.logits] for r in engine.batch_prefill(requests).results]  # each request's tokens kept on it
    for _ in range(5):
        step = engine.batch_decode_step(requests)
        for s in range(2):
            logits[s].append(step.logits[s])
    hf = hf_reference(checkpoint(preset, norm_noise=NORM_NOISE))
    for s, request in enumerate(requests):
        tokens = request.generated_tokens
        ref = hf_incremental_logits(hf, request.prompt_tokens, tokens[:-1])
        assert_matches_reference(ref, torch.stack(logits[s]), tokens, dtype="float16", tol=0.02)


def test_the_norm_weights_move_only_where_a_launch_then_norms_the_rows(make_engine, monkeypatch):
    """`fold_norm_weights`: "auto" moves every pre-norm's weight where few-row matmuls take the TMA ring (sm_90: its
    residual epilogue leaves the next norm its row squares), and elsewhere only the MLP's, only where no GEMV takes
    gate_up's one-row call (the fused matmul then norms the row); never while the fused kernels are off. "always"
    and "never" say so; the batch-invariant mode refuses "always"."""

    def folded(**options) -> tuple[bool, bool]:
        layer = make_engine("tiny-qwen3", **options).model.layers[0]
        return layer.input_norm.unit, layer.post_norm.unit

    assert folded() == (RING, RING) and folded(fused_linear="triton", gemv_rows=1) == (RING, RING)
    assert folded(fused_linear="triton", gemv_rows=0) == (RING, True)  # "auto", the default
    assert folded(fused_linear="triton", fold_norm_weights="always") == (True, True)
    assert folded(fused_linear="triton", gemv_rows=0, fold_norm_weights="never") == (False, False)
    monkeypatch.setenv("POCKETLAB_MATMUL_TMA", "64:3:0")  # the ring switched in, as on sm_90
    assert folded(fused_linear="triton", gemv_rows=1) == (True, True) and folded() == (RING, RING)
    with pytest.raises(ValueError, match="fold_norm_weights"):
        EngineOptions(batch_invariant=True, fold_norm_weights="always")
    with pytest.raises(ValueError, match="fold_norm_weights"):
        EngineOptions(fold_norm_weights="yes")


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3_5"])
def test_repetition_penalty_decodes_as_hf_generate(preset, make_engine, checkpoint):
    """Greedy with a repetition penalty (as Qwen2/2.5 instruct checkpoints ship in generation_config.json) gives
    HF generate's tokens, in a batch beside an unpenalized request, prompts below and above the prefill chunk. Each
    prompt starts with the token the model predicts after it, so the penalty over the prompt decides the first
    token, and the penalty changes the tokens: the check can fail."""
    if DTYPE != "float32":
        pytest.skip("token identity against HF float32 is a float32 check")
    hf = hf_reference(checkpoint(preset))
    new, eng = 24, make_engine(preset)
    penalized, plain = SamplingParams(repetition_penalty=1.5, max_new_tokens=new), SamplingParams(max_new_tokens=new)
    other = random_prompt(7, seed=4)
    for p in (random_prompt(11, seed=5), random_prompt(23, seed=6)):
        p = eng.generate([p], SamplingParams(max_new_tokens=1))[0] + p
        with torch.no_grad():
            want = hf.generate(torch.tensor([p], device=DEVICE), do_sample=False, repetition_penalty=1.5,
                               max_new_tokens=new)[0, len(p):].tolist()  # fmt: skip
        got, beside = eng.generate([p, other], [penalized, plain])
        assert got == want
        assert got[0] != eng.generate([p], plain)[0][0]
        assert beside == eng.generate([other], plain)[0]
