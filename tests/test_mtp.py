"""The MTP head: config and weights load, and its draft logits equal an independent re-implementation of

    logits = lm_head(norm(layer(fc(cat(norm_e(embed(x_{t+1})), norm_h(h_t))))))

written here from the raw safetensors tensors, with h_t from HF transformers' own forward (float32, 1e-4).
"""

import json

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import DEVICE, DTYPE, LOGIT_TOL, greedy_run, random_prompt
from safetensors.torch import load_file

from pocketlab import BatchedRequest, EngineOptions, QwenEngine
from pocketlab.config import ModelConfig
from pocketlab.layers.gated_delta import backend_name
from pocketlab.speculative import MTPDrafter, choose

PRESET = "tiny-qwen3_5-mtp"


# -- the reference, from nothing but the checkpoint files ---------------------------------------
def raw_weights(path):
    w = {}
    for f in sorted(path.glob("*.safetensors")):
        w |= {
            k.removeprefix("model.language_model.").removeprefix("model."): v.float() for k, v in load_file(f).items()
        }
    return w


def norm1p(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


def rotate(x, pos, rot, theta):
    """Rotate-half RoPE on the first `rot` dims of x [T, H, hd] at integer positions pos [T]."""
    inv = 1.0 / theta ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    ang = pos[:, None].double() * inv[None, :]
    cos, sin = ang.cos().float()[:, None, :], ang.sin().float()[:, None, :]
    a, b, rest = x[..., : rot // 2], x[..., rot // 2 : rot], x[..., rot:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, rest], dim=-1)


def reference_mtp(w, c, hidden, tokens, positions):
    """MTP rows (h_t, x_{t+1}) -> (logits [T, V], normed outputs [T, d]); causal attention over the rows given."""
    eps, hd, nq, nkv = c["rms_norm_eps"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    rot = int(hd * c["rope_parameters"]["partial_rotary_factor"])
    theta = c["rope_parameters"]["rope_theta"]
    T = len(tokens)
    e = w["embed_tokens.weight"][torch.tensor(tokens)]
    x = (
        torch.cat(
            [
                norm1p(e, w["mtp.pre_fc_norm_embedding.weight"], eps),
                norm1p(hidden, w["mtp.pre_fc_norm_hidden.weight"], eps),
            ],
            dim=-1,
        )
        @ w["mtp.fc.weight"].T
    )
    p = "mtp.layers.0."
    h = norm1p(x, w[p + "input_layernorm.weight"], eps)
    qg = (h @ w[p + "self_attn.q_proj.weight"].T).view(T, nq, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(T, nq * hd)
    k = (h @ w[p + "self_attn.k_proj.weight"].T).view(T, nkv, hd)
    v = (h @ w[p + "self_attn.v_proj.weight"].T).view(T, nkv, hd)
    q = rotate(norm1p(q, w[p + "self_attn.q_norm.weight"], eps), positions, rot, theta)
    k = rotate(norm1p(k, w[p + "self_attn.k_norm.weight"], eps), positions, rot, theta)
    k, v = k.repeat_interleave(nq // nkv, dim=1), v.repeat_interleave(nq // nkv, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) * hd**-0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    att = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(T, nq * hd)
    x = x + (att * torch.sigmoid(gate)) @ w[p + "self_attn.o_proj.weight"].T
    h = norm1p(x, w[p + "post_attention_layernorm.weight"], eps)
    x = (
        x
        + (F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T))
        @ w[p + "mlp.down_proj.weight"].T
    )
    out = norm1p(x, w["mtp.norm.weight"], eps)
    head = w.get("lm_head.weight", w["embed_tokens.weight"])
    return out @ head.T, out


@pytest.fixture(scope="module")
def ref(checkpoint):
    if backend_name("cuda") == "fla":  # seen on the H200 machine, transformers 5.17 + fla 0.6
        pytest.skip(
            "HF's Qwen3.5 hands CPU tensors to fla's Triton kernels when fla is installed; this float32 "
            "reference runs where fla is absent (CI)"
        )
    path = checkpoint(PRESET)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cfg = json.loads((path / "config.json").read_text())

    @torch.inference_mode()
    def hidden(tokens):
        """HF's final-normed hidden states [T, d] (checked: lm_head of them is HF's logits)."""
        ids = torch.tensor([tokens])
        h = hf.model(input_ids=ids).last_hidden_state[0]
        torch.testing.assert_close(hf.lm_head(h), hf(input_ids=ids).logits[0], atol=1e-5, rtol=0)
        return h

    return dict(path=path, w=raw_weights(path), cfg=cfg, hidden=hidden)


# -- config and weights ------------------------------------------------------------------------
def test_checkpoint_declares_the_head_where_qwen3_5_does(ref):
    """text config key mtp_num_hidden_layers (HF's config class keeps it; HF's model ignores mtp.*)."""
    path = ref["path"]
    assert ref["cfg"]["mtp_num_hidden_layers"] == 1
    assert transformers.AutoConfig.from_pretrained(path).mtp_num_hidden_layers == 1
    assert ModelConfig.from_pretrained(path).mtp_num_hidden_layers == 1
    nested = ModelConfig.from_dict(
        {"model_type": "qwen3_5", "text_config": dict(ref["cfg"], model_type="qwen3_5_text")}
    )
    assert nested.mtp_num_hidden_layers == 1
    assert {k for k in ref["w"] if k.startswith("mtp.")} >= {
        "mtp.fc.weight",
        "mtp.norm.weight",
        "mtp.layers.0.self_attn.q_proj.weight",
    }


def test_head_built_only_when_speculating(make_engine, ref):
    assert make_engine(PRESET).model.mtp is None
    eng = make_engine(PRESET, speculative_tokens=1)
    head = eng.model.mtp
    assert torch.equal(head.fc.float().cpu(), ref["w"]["mtp.fc.weight"])
    assert torch.equal(head.norm.weight.float().cpu(), ref["w"]["mtp.norm.weight"])
    assert "mtp" in eng.cache.k and "mtp_hidden" in eng.cache.extra


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3_5"])
def test_models_without_a_head_refuse_speculation(make_engine, preset):
    with pytest.raises(ValueError, match="needs an MTP head"):
        make_engine(preset, speculative_tokens=2)
    make_engine(preset)  # and still load fine without it


def test_options_are_checked():
    with pytest.raises(ValueError, match="speculative_tokens"):
        EngineOptions(speculative_tokens=-1)
    with pytest.raises(ValueError, match="speculative_tokens"):
        EngineOptions(speculative_tokens=99)
    with pytest.raises(ValueError, match="rollback"):
        EngineOptions(speculative_tokens=1, speculative_rollback="nope")


# -- draft logits ------------------------------------------------------------------------------
class HalfRight(MTPDrafter):
    """The MTP head runs as usual (its KV, queue, recursion), but the draft tokens alternate between the
    known greedy continuation and the head's own pick, so 0 < accepted < k happens and multi-row queue
    refills get exercised, which the random head alone (acceptance ~0) would never do."""

    def __init__(self, references):
        super().__init__()
        self.references = references

    def pick(self, logits, rows, i):
        tokens, probs = choose(logits, rows, [r.position + i for r in rows])
        for j, r in enumerate(rows):
            seq = self.references[r.slot]
            if (r.position + i) % 3 and r.position + i < len(seq):
                tokens[j] = seq[r.position + i]
        return tokens, probs


def greedy_reference(path, prompts, steps):
    eng = QwenEngine.from_pretrained(
        path, EngineOptions(max_slots=len(prompts), max_seq_len=128, prefill_chunk=8, device=DEVICE, dtype=DTYPE)
    )
    return [list(p) + greedy_run(eng, p, steps, slot_id=s)[0] for s, p in enumerate(prompts)]


@pytest.mark.parametrize("k", [1, 3])
def test_draft_logits_match_reference(ref, k):
    """Two slots decoded together; every draft of every step (recursive ones too) against the reference."""
    if DTYPE != "float32":
        pytest.skip("a float32 check")
    prompts = [random_prompt(11, seed=21), random_prompt(6, seed=22)]
    seqs = greedy_reference(ref["path"], prompts, 40)
    eng = QwenEngine.from_pretrained(
        ref["path"],
        EngineOptions(max_slots=2, max_seq_len=128, prefill_chunk=8, speculative_tokens=k, device=DEVICE, dtype=DTYPE),
    )
    drafter = eng.speculator.use(HalfRight({0: seqs[0], 1: seqs[1]}))
    drafter.trace = []
    reqs = [BatchedRequest(i, p, slot_id=i) for i, p in enumerate(prompts)]
    eng.batch_prefill(reqs)
    while min(len(r.generated_tokens) for r in reqs) < 30:
        eng.batch_decode_step(reqs)
    for r, seq in zip(reqs, seqs, strict=True):
        assert r.generated_tokens == seq[len(r.prompt_tokens) :][: len(r.generated_tokens)]
    assert 0 < eng.speculator.stats.accepted < eng.speculator.stats.drafted

    hiddens = {s: ref["hidden"](seq) for s, seq in enumerate(seqs)}
    chains = {}  # (slot, position) -> rows so far (hidden, token) for the recursion
    worst, checked = 0.0, 0
    for entry in drafter.trace:
        for j, (slot, n) in enumerate(zip(entry["slots"], entry["positions"], strict=True)):
            seq, H = seqs[slot], hiddens[slot]
            if entry["draft"] == 1:  # rows t = 0 .. n-1: (h_t, x_{t+1}), all real
                rows_h, rows_x = list(H[:n]), seq[1 : n + 1]
            else:  # one more recursive row: the head's previous output and the previous draft
                rows_h, rows_x, prev_out, prev_tok = chains[(slot, n)]
                rows_h, rows_x = rows_h + [prev_out], rows_x + [prev_tok]
            logits, out = reference_mtp(ref["w"], ref["cfg"], torch.stack(rows_h), rows_x, torch.arange(len(rows_x)))
            chains[(slot, n)] = (rows_h, rows_x, out[-1], entry["tokens"][j])
            worst = max(worst, float((entry["logits"][j] - logits[-1]).abs().max()))
            checked += 1
            if checked <= 3:  # the other convention: rotate row t at t + 1 (RoPE is relative: same logits)
                shifted, _ = reference_mtp(
                    ref["w"], ref["cfg"], torch.stack(rows_h), rows_x, torch.arange(len(rows_x)) + 1
                )
                assert float((shifted[-1] - logits[-1]).abs().max()) <= 1e-4
    print(f"k={k}: {checked} draft logits, max |diff| vs reference = {worst:.2e}")
    assert checked >= 30
    assert worst <= LOGIT_TOL
