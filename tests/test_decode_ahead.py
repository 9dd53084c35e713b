"""A greedy decode step launches the next step of its slots before it returns (StepGraphs.launch_ahead), fed its
argmax on the device. Checked on the CPU through SharedPoolGraphs (and with real captures on CUDA), for attention-only
models and hybrids (whose launched step stores its Gated DeltaNet states aside): the launched step serves the next
call only where that call feeds those slots the tokens it was fed from an unchanged history, gives the bits a fresh
replay gives, and shows nowhere."""

import dataclasses

import pytest
import torch
from conftest import DEVICE, random_prompt

from pocketlab import BatchedRequest, EngineOptions, ModelConfig, graphs
from pocketlab.cache import linear_state_bytes
from pocketlab.sampling import SamplingParams
from pocketlab.tools.synthetic import hf_config
from pocketlab.verify.graph_doubles import rerun_graphs

SHAPE = dict(max_slots=4, max_seq_len=160, prefill_graph_tokens=0)  # decode graphs only; keys cross 128 -> 160


def engine(make_engine, ahead: bool, cuda: bool = False, preset: str = "tiny-qwen3", **options):
    """An engine with decode graphs: real ones (cuda) or their CPU double (graph_doubles.rerun_graphs), counting its
    decode graphs' replay() calls (launches ahead are not among them)."""
    eng = make_engine(preset, decode_ahead=ahead, **SHAPE | options, **({} if cuda else dict(cuda_graphs=False)))
    if not cuda:
        rerun_graphs(eng)
    replay, eng.replays = eng.graphs.replay, 0

    def counted(name, *args, **kwargs):
        eng.replays += name == "decode"
        return replay(name, *args, **kwargs)

    eng.graphs.replay = counted
    return eng


PRESETS = pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3_5"], ids=["dense", "hybrid"])


@PRESETS
@pytest.mark.parametrize("cuda", [False, True], ids=["rerun", "cuda"])
def test_greedy_steps_are_served_by_the_step_launched_ahead_bit_for_bit(make_engine, cuda, preset):
    """Three greedy slots decode 20 steps: each step after the first in a key bucket is the one the step before
    launched (two replays in all: the first step, and the first past 128 keys, whose graph nothing had captured;
    one at the hybrid, whose launched steps replay graphs of their own, captured as they are first launched), and
    tokens and logits are those of the same graphs replayed step by step."""
    if cuda and DEVICE != "cuda":
        pytest.skip("real CUDA graphs: POCKETLAB_DEVICE=cuda")
    prompts = [random_prompt(n, seed=80 + n) for n in (3, 9, 115)]
    results = []
    for ahead in (False, True):
        eng = engine(make_engine, ahead, cuda, preset)
        reqs = [BatchedRequest(i, p) for i, p in enumerate(prompts)]
        eng.batch_prefill(reqs)
        logits = torch.stack([eng.batch_decode_step(reqs).logits for _ in range(20)])
        results.append(([r.generated_tokens for r in reqs], logits, eng.replays, eng.forward_count))
    (want, want_logits, replays, forwards), (got, got_logits, replays_ahead, forwards_ahead) = results
    assert eng.decodes_ahead and eng.graphs.ahead is not None
    assert (replays, replays_ahead) == (20, 1 if eng.cfg.linear_layers else 2) and forwards_ahead == forwards
    assert got == want and torch.equal(got_logits, want_logits)


def schedule(eng) -> list:
    """Calls a launched step must not serve, between greedy steps it may: another batch, a token other than the
    argmax, another slot's prompt, and a slot restored to another history at the same position whose next token is
    the one the launched step was fed. The logits of every call."""
    a, b, c = (random_prompt(n, seed=90 + i) for i, n in enumerate((12, 12, 7)))
    out = [eng.prefill(a, slot_id=0).logits, eng.prefill(b, slot_id=1).logits]
    reqs = [BatchedRequest(0, a, slot_id=0), BatchedRequest(1, b, slot_id=1)]
    reqs[0].generated_tokens, reqs[1].generated_tokens = [out[0].argmax().item()], [out[1].argmax().item()]
    out += list(eng.batch_decode_step(reqs).logits)  # launches [0, 1]
    out += list(eng.batch_decode_step(reqs).logits)  # served
    out.append(eng.prefill(c, slot_id=2).logits)  # another slot: [0, 1]'s launched step still holds
    out += list(eng.batch_decode_step(reqs).logits)  # served
    reqs[1].generated_tokens[-1] = (reqs[1].last_token + 1) % eng.cfg.vocab_size  # not the argmax fed ahead
    out += list(eng.batch_decode_step(reqs).logits)
    for _ in range(2):  # one slot of the two: another batch, then slot 1's steps served one by one
        out.append(eng.decode_step(reqs[1].last_token, slot_id=1).logits)
        reqs[1].generated_tokens.append(out[-1].argmax().item())
    step = eng.decode_step(reqs[0].last_token, slot_id=0)  # another slot
    fed = eng.decode_step(step.next_token, slot_id=0)  # served; launches slot 0's next step, fed fed.next_token
    out += [step.logits, fed.logits]
    assert eng.position(1) == eng.position(0)
    eng.restore(eng.snapshot(1), slot_id=0)  # slot 0: the same position, slot 1's history
    out.append(eng.decode_step(fed.next_token, slot_id=0).logits)  # the token slot 0's launched step was fed
    return out


@PRESETS
def test_a_step_launched_ahead_serves_no_other_call(make_engine, preset):
    """Every call of `schedule` gives the bits of an engine that launches nothing ahead, and the slots' Gated
    DeltaNet states end as its do (the last call's launched step, never served, stored its states aside)."""
    plain, eng = engine(make_engine, False, preset=preset), engine(make_engine, True, preset=preset)
    want, got = schedule(plain), schedule(eng)
    assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert eng.replays == plain.replays - 4  # the four steps served
    assert eng.graphs.ahead is not None
    assert torch.equal(eng.cache.rec_bank, plain.cache.rec_bank) and torch.equal(
        eng.cache.conv_bank, plain.cache.conv_bank
    )


@PRESETS
@pytest.mark.parametrize("cuda", [False, True], ids=["shared-pool", "cuda"])
def test_a_step_launched_ahead_copies_its_outputs_before_another_graph_replays(make_engine, cuda, preset):
    """The graphs share one memory pool, so a replay may overwrite another graph's outputs (the CPU's graphs here,
    SharedPoolGraphs, spoil them all at every replay): a launched step copies its logits and tokens out at once, and
    `schedule`'s prompt on another slot, replayed from a prompt graph before the launched step is taken, changes no
    bit. Without the copy the taken step fed its spoiled tokens to the next (an embedding index out of range: on
    CUDA, the isolation notebook's device-side assert of the fiftieth session; there real captures, whose memory
    the allocator places, need not overlap)."""
    if cuda and DEVICE != "cuda":
        pytest.skip("real CUDA graphs: POCKETLAB_DEVICE=cuda")
    prompt_graphs = dict(prefill_graph_tokens=48)
    plain, eng = (engine(make_engine, ahead, cuda, preset, **prompt_graphs) for ahead in (False, True))
    want, got = schedule(plain), schedule(eng)
    assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert eng.replays == plain.replays - 4 and any(key[0] == "prefill" for key in eng.graphs.graphs)


@pytest.mark.parametrize(
    ("preset", "options"),
    [
        ("tiny-qwen3_5", dict(batch_invariant=True)),
        ("tiny-qwen3_5-mtp", dict(speculative_tokens=2)),
        ("tiny-qwen3", dict(decode_ahead=False)),
    ],
    ids=["hybrid-invariant", "drafts", "off"],
)
def test_no_step_is_launched_ahead_where_a_step_changes_state_in_place(make_engine, preset, options):
    """The batch-invariant mode's Gated DeltaNet kernels update their slots' states in place and drafts move the MTP
    queue: a step launched ahead could not be left unseen, so none is. Nor with decode_ahead off."""
    eng = engine(make_engine, options.pop("decode_ahead", True), preset=preset, **options)
    reqs = [BatchedRequest(0, random_prompt(9, seed=3))]
    eng.batch_prefill(reqs)
    for _ in range(3):
        eng.batch_decode_step(reqs)
    assert not eng.decodes_ahead and eng.graphs.ahead is None


def test_a_hybrid_launches_ahead_only_batches_its_rows_aside_hold(make_engine, monkeypatch):
    """The rows aside hold graphs.ASIDE_BYTES of Gated DeltaNet states, a batch bucket's worth: here one slot's, so
    one slot's steps launch ahead and two slots' do not, and both decode as an engine that launches nothing."""
    one_row = linear_state_bytes(engine(make_engine, False, preset="tiny-qwen3_5").cfg, 4)
    monkeypatch.setattr(graphs, "ASIDE_BYTES", one_row)
    eng, plain = (engine(make_engine, ahead, preset="tiny-qwen3_5") for ahead in (True, False))
    assert eng.cache.aside_rows == 1 and eng.cache.rec_aside.shape[1] == 1
    for e in (eng, plain):
        e.reqs = [BatchedRequest(i, random_prompt(6 + i, seed=30 + i)) for i in range(2)]
        e.batch_prefill(e.reqs)
        for n in (2, 2, 1, 1, 1):
            e.batch_decode_step(e.reqs[:n])
            assert (e.graphs.ahead is not None) == (e is eng and n == 1)
    assert [r.generated_tokens for r in eng.reqs] == [r.generated_tokens for r in plain.reqs]
    assert eng.replays == plain.replays - 2  # the last two steps of one slot served


@pytest.mark.parametrize(
    ("preset", "rows"), [("qwen3.5-0.8b", 2), ("qwen3.5-9b", 1), ("qwen3.5-35b-a3b", 1), ("qwen3-8b", 0)]
)
def test_the_rows_aside_at_the_real_shapes(preset, rows):
    """graphs.ASIDE_BYTES of rows aside, at the real shapes' Gated DeltaNet states (bf16 windows, fp32 states): the
    batches whose steps launch ahead there (README's figures). None at a dense model or with the option off."""
    cfg = ModelConfig.from_dict(hf_config(preset).to_dict())
    options = EngineOptions(max_slots=32, dtype="bfloat16", decode_ahead=True)
    assert graphs.aside_rows(cfg, options) == rows
    assert graphs.aside_rows(cfg, dataclasses.replace(options, decode_ahead=False)) == 0


def test_a_step_that_ends_a_request_launches_nothing_ahead(make_engine):
    """batch_decode_step(go_on=False) launches nothing; generate() says so at each step after which a request ends by
    length (its batch changes next), so its last step leaves nothing running, and it generates what an engine that
    launches nothing ahead generates."""
    prompts = [random_prompt(n, seed=60 + n) for n in (5, 17, 30)]
    sampling = [SamplingParams(max_new_tokens=n) for n in (4, 9, 6)]
    want = engine(make_engine, False).generate(prompts, sampling)
    eng = engine(make_engine, True)
    assert eng.generate(prompts, sampling) == want and eng.graphs.ahead is None
    reqs = [BatchedRequest(0, prompts[0])]
    eng.batch_prefill(reqs)
    eng.batch_decode_step(reqs)
    assert eng.graphs.ahead is not None
    eng.batch_decode_step(reqs, go_on=False)
    assert eng.graphs.ahead is None
