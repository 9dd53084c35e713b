"""Engine vs HF transformers from the same checkpoint folder: logits and greedy tokens."""
import pytest
import torch
import transformers

from conftest import DEVICE, DTYPE, LOGIT_TOL, greedy_run, random_prompt

CHUNK = 16


def hf_reference(path):
    # In low precision the reference is HF in float32 on the same device: we measure our error, not theirs.
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEVICE).eval()


def assert_matches_reference(ref_logits, ours, tokens):
    """Logits within tolerance; greedy tokens identical wherever the reference is not a near-tie."""
    scale = 1.0 if DTYPE == "float32" else ref_logits.abs().max().item()
    diff = (ours.float().cpu() - ref_logits.cpu()).abs().max().item()
    assert diff <= LOGIT_TOL * scale, f"max |logits diff| {diff:.3g} > {LOGIT_TOL * scale:.3g}"
    top2 = ref_logits.topk(2, dim=-1).values
    decisive = (top2[:, 0] - top2[:, 1]) > 2 * LOGIT_TOL * scale
    ref_tokens = ref_logits.argmax(-1)
    if DTYPE == "float32":
        assert decisive.all(), "random weights gave a near-tie; choose another seed"
    assert torch.equal(ref_tokens[decisive].cpu(), torch.tensor(tokens)[decisive.cpu()])
    return diff


@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-qwen3"])
@pytest.mark.parametrize("length", [1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5])
def test_greedy_parity_with_hf(preset, length, make_engine, checkpoint):
    engine = make_engine(preset, prefill_chunk=CHUNK)
    steps = 33
    tokens, logits = greedy_run(engine, random_prompt(length, seed=length), steps)
    full = random_prompt(length, seed=length) + tokens[:-1]
    with torch.no_grad():
        ref = hf_reference(checkpoint(preset))(torch.tensor([full], device=DEVICE)).logits[0, length - 1:]
    diff = assert_matches_reference(ref.float(), logits, tokens)
    print(f"{preset} prompt={length}: max |diff| = {diff:.2e}")


def test_tied_embeddings_parity(make_engine, checkpoint):
    from pocketlab import EngineOptions, QwenEngine
    path = checkpoint("tiny-qwen3", tie_word_embeddings=True)
    engine = QwenEngine.from_pretrained(path, EngineOptions(device=DEVICE, dtype=DTYPE, max_seq_len=64))
    assert engine.model.lm_head is engine.model.embed
    tokens, logits = greedy_run(engine, random_prompt(7, seed=3), 8)
    with torch.no_grad():
        ref = hf_reference(path)(torch.tensor([random_prompt(7, seed=3) + tokens[:-1]], device=DEVICE)).logits[0, 6:]
    assert_matches_reference(ref.float(), logits, tokens)
