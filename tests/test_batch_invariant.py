"""The batch-invariant mode: a request's logits are bitwise the same whatever else the engine runs.

On the CPU the Triton kernels run in Triton's interpreter, so these tests check the same kernels the GPU runs.
Each mutant switches ONE kernel of the mode back to a batch-variant one; the invariance check must then fail,
which shows that every kernel on the path is needed and that the check can see the difference.
"""

import copy
import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, greedy_run, random_prompt

import pocketlab.layers.invariant as inv
import pocketlab.models.qwen3 as qwen3
from pocketlab import EngineOptions
from pocketlab.layers import activations
from pocketlab.layers.attention import write_kv
from pocketlab.layers.decode_attention import split_length
from pocketlab.layers.gated_delta import backend_name
from pocketlab.layers.kernels import kernels_for
from pocketlab.layers.linear import composed
from pocketlab.layers.rotary import apply_rotary
from pocketlab.verify.common import load_pair, seq_len_for
from pocketlab.verify.invariance import CASES, _solo, compare, invariance


@pytest.fixture(scope="module")
def pairs():
    made = {}

    def get(model, dtype="float32"):
        if (model, dtype) not in made:
            made[model, dtype] = load_pair(model, device=DEVICE, dtype=dtype)
        return made[model, dtype]

    return get


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-qwen3_5"])
def test_every_schedule_gives_the_solo_logits_bit_for_bit(pairs, model):
    r = invariance(pairs(model), num_slots=3, steps=2, prompt_lens=[5, 11, 18])
    assert r.passed, r.summary.to_string()
    assert set(r.summary.case) == set(CASES)


@pytest.mark.skipif(DEVICE != "cuda", reason="16-bit kernels on the GPU (the CPU runs float32)")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-qwen3_5"])
def test_every_schedule_is_bitwise_in_16_bits(pairs, model, dtype):
    """bf16 and fp16 on CUDA: 40 slots (random subsets reach every graph bucket up to 64), prompts of 1-300
    tokens (several key splits), graphs on; and a solo run with graphs off gives the graphed run's bits."""
    lens = [5, 300, 18, 1, 77, 140, 9, 260, 33] + [3 + (7 * i) % 50 for i in range(31)]
    r = invariance(pairs(model, dtype), num_slots=40, steps=12, prompt_lens=lens)
    assert r.passed, r.summary.to_string()
    prompt = random_prompt(70, seed=3)
    graphed, eager = (
        _solo(
            pairs(model, dtype).engine(max_slots=2, max_seq_len=128, batch_invariant=True, cuda_graphs=g), prompt, 8, 1
        )
        for g in (True, False)
    )
    assert compare(graphed, eager)["bitwise"]


# -- mutants: one kernel switched back to a batch-variant implementation --------------------------------
def _rows(x):
    return x.reshape(-1, x.shape[-1]).shape[0]


def split_k_matmul(x, w, bias=None):
    """cuBLAS-style split-K whose split count depends on the number of rows."""
    parts = 1 + _rows(x) % 3
    y = sum(F.linear(xs, ws) for xs, ws in zip(x.tensor_split(parts, -1), w.tensor_split(parts, -1), strict=True))
    return y if bias is None else y + bias


def _around(matmul):
    """A linear whose matmul is `matmul`; its SwiGLU the invariant kernel's."""
    return functools.partial(composed, matmul, activation=inv.swiglu)


def _split_sum_norm(x, weight, eps, offset):
    """rms_norm summing the squares in a number of pieces that depends on the number of rows."""
    xf = x.float()
    parts = 1 + _rows(x) % 3
    ss = sum(p.pow(2).sum(-1, keepdim=True) for p in xf.tensor_split(parts, -1))
    xf = xf * torch.rsqrt(ss / x.shape[-1] + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype) if offset else weight * xf.to(x.dtype)


def split_norm_rotate_store(q, k, v, k_cache, v_cache, targets, rope, norms):
    """The unfused torch path, its q/k norms summing in pieces that depend on the number of rows."""
    if norms is not None:
        q, k = (_split_sum_norm(t, w, norms[2], norms[3]) for t, w in ((q, norms[0]), (k, norms[1])))
    q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
    write_kv(k_cache, v_cache, k, v, targets)
    return q


MUTANTS = {
    # the default kernels where they are batch-variant on this device, else a stand-in that behaves like them
    "linear: split-K by batch size": ("linear", _around(F.linear if DEVICE == "cuda" else split_k_matmul)),
    # torch's own norm happened to reduce hidden size 64 in one order at every batch size on the H200
    "rms_norm: row split by batch size": ("rms_norm", _split_sum_norm),
    "attention: the default SDPA / decode kernel": ("attention", None),
    "norm_rotate_store: q/k norms split by batch size": ("norm_rotate_store", split_norm_rotate_store),
}
if DEVICE == "cpu":  # torch's CPU softplus/sigmoid differ between SIMD lanes and the scalar tail
    MUTANTS["decay_and_beta: torch elementwise"] = ("decay_and_beta", activations.decay_and_beta)


# On CUDA the attention mutant's decode kernel cuts a sequence's keys into as many splits as fill the GPU, so how
# many depends on the batch's size; but never fewer than 64 keys a split (the tiny model's float32 key block), so
# at 18 keys solo and batched runs merge one split alike and the mutant went unnoticed. At this length they differ.
LONG_PROMPT = 2800


def test_the_long_prompt_splits_its_keys_by_the_batch_size():
    keys, kv_heads = seq_len_for([LONG_PROMPT], 2), 2  # the mutant run's key bucket; the tiny model's kv heads
    assert split_length(kv_heads, keys, 64) != split_length(3 * kv_heads, keys, 64)


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_each_kernel_switched_back_is_caught(pairs, monkeypatch, mutant):
    field, fn = MUTANTS[mutant]
    model = "tiny-qwen3_5" if field == "decay_and_beta" else "tiny-qwen3"

    def mutated(options):
        return dataclasses.replace(kernels_for(options), **{field: fn})

    monkeypatch.setattr(qwen3, "kernels_for", mutated)
    lens = [5, 11, LONG_PROMPT if field == "attention" and DEVICE == "cuda" else 18]
    r = invariance(pairs(model), num_slots=3, steps=2, prompt_lens=lens, cases=("batched", "chunked_prefill"))
    assert not r.summary.bitwise.all(), f"{mutant} went unnoticed:\n{r.summary.to_string()}"


def test_delta_rule_switched_back_to_the_chunked_form_is_caught(pairs, monkeypatch):
    """The default prompt path (chunked delta rule over gathered states) sums in another order than decode. Prompts
    longer than its 64-token chunks, so that one piece and pieces of 3 cut the chunks differently."""
    kernels = dataclasses.replace(
        kernels_for(EngineOptions(batch_invariant=True, device=DEVICE)), delta_rule_in_place=False
    )
    monkeypatch.setattr(qwen3, "kernels_for", lambda options: kernels)
    cases = ("batched", "chunked_prefill")
    r = invariance(pairs("tiny-qwen3_5"), num_slots=2, steps=1, prompt_lens=[70, 90], cases=cases)
    assert not r.summary.bitwise.all(), r.summary.to_string()


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-qwen3_5", "tiny-qwen3_moe", "tiny-qwen3_5_moe"])
def test_batch_invariant_mode_matches_hf(pairs, model):
    """The invariant kernels compute the same model: float32 logits within 1e-4 of HF's over prefill and decode.
    HF runs on the CPU (on CUDA its float32 Qwen3.5 takes fla's TF32 kernels, 1e-2 off). Qwen3.5-MoE: the shared
    expert's gate is one value per token, broadcast over the hidden dim by the invariant sigmoid-gate kernel."""
    if model.startswith("tiny-qwen3_5") and backend_name(DEVICE) == "fla":
        pytest.skip("HF's Qwen3.5 runs fla's CUDA-only kernels when fla is installed; the CPU run checks it")
    pair = pairs(model)
    eng = pair.engine(max_slots=2, max_seq_len=64, batch_invariant=True)
    prompt = random_prompt(13, seed=4)
    tokens, logits = greedy_run(eng, prompt, 4)
    with torch.inference_mode():
        ref = copy.deepcopy(pair.hf).cpu()(input_ids=torch.tensor([prompt + tokens[:-1]])).logits[0].float()
    assert (logits.cpu() - ref[len(prompt) - 1 :]).abs().max() <= 1e-4


@pytest.mark.parametrize("drafter", ["oracle", "adversarial"])
def test_speculative_greedy_output_and_logits_equal_plain_decoding_bitwise(make_engine, drafter):
    """Verify forwards over k+1 tokens give each position the logits of plain one-token decode steps."""
    from pocketlab.verify.drafters import AdversarialDrafter, OracleDrafter

    prompt, steps = random_prompt(9, seed=2), 6
    plain = make_engine("tiny-qwen3_5-mtp", batch_invariant=True)
    ref_tokens, ref_logits = greedy_run(plain, prompt, steps + 3)
    spec = make_engine("tiny-qwen3_5-mtp", batch_invariant=True, speculative_tokens=2)
    spec.speculator.use(OracleDrafter({0: ref_tokens}) if drafter == "oracle" else AdversarialDrafter({0: ref_tokens}))
    r = spec.prefill(prompt)
    got = [r.next_token]
    assert torch.equal(r.logits, ref_logits[0])
    while len(got) < steps:
        r = spec.decode_step(got[-1])
        got += r.tokens
        assert torch.equal(r.logits, ref_logits[len(got) - 1]), f"position {len(prompt) + len(got) - 1}"
    assert got == ref_tokens[: len(got)]


def test_the_mode_refuses_what_it_cannot_keep(monkeypatch):
    with pytest.raises(ValueError, match="rollback"):
        EngineOptions(batch_invariant=True, speculative_rollback="replay", device=DEVICE)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # decides only for device="cpu"
    with pytest.raises(ValueError, match="interpreter"):
        EngineOptions(batch_invariant=True, device="cpu")
