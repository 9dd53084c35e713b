"""Speculative decoding is exact: greedy output is token-identical to plain greedy decoding (MTP, oracle,
adversarial and half-right drafters, k = 1, 2, 3, one slot and several batched and interleaved), rolled-back
state equals plain decoding's, and sampled tokens follow plain sampling's law (chi-square, alpha = 1e-3)."""

import pytest
import torch
from conftest import DEVICE, DTYPE, KERNELS, random_prompt
from test_graphs import FailingGraphs

from pocketlab import BatchedRequest, EngineOptions, QwenEngine, SamplingParams
from pocketlab.forward import Run
from pocketlab.speculative import Drafter, Drafts
from pocketlab.verify import mtp_runs, mtp_sampling
from pocketlab.verify.drafters import AdversarialDrafter, OracleDrafter
from pocketlab.verify.graph_doubles import rerun_graphs

PRESET = "tiny-qwen3_5-mtp"
PROMPTS = [random_prompt(5, seed=31), random_prompt(9, seed=32), random_prompt(14, seed=33)]
NEW = 64


@pytest.fixture(scope="module")
def path(checkpoint):
    return checkpoint(PRESET)


def engine(path, k, **kw):
    opts = dict(max_slots=3, max_seq_len=96, prefill_chunk=8, device=DEVICE, dtype=DTYPE, speculative_tokens=k)
    opts |= KERNELS | kw
    return QwenEngine.from_pretrained(path, EngineOptions(**opts))


@pytest.fixture(scope="module")
def reference(path):
    """Plain greedy decoding, each prompt alone: prompt + NEW + 4 tokens."""
    return mtp_runs.plain_greedy(engine(path, 0), PROMPTS, NEW + 3)


def drafter(name, refs):
    refs = dict(enumerate(refs))
    return {
        "oracle": lambda: OracleDrafter(refs),
        "adversarial": lambda: AdversarialDrafter(refs),
        "half": lambda: OracleDrafter(refs, accuracy=0.5, seed=3),
    }[name]()


def check_equal(reqs, reference):
    for r, ref in zip(reqs, reference, strict=True):
        assert r.generated_tokens[: NEW + 1] == ref[len(r.prompt_tokens) :][: NEW + 1], f"slot {r.slot_id}"
        assert len(r.generated_tokens) >= NEW + 1


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("name", ["mtp", "oracle", "adversarial", "half"])
def test_greedy_batched_interleaved_equals_plain(path, reference, name, k):
    eng = engine(path, k)
    if name != "mtp":
        eng.speculator.use(drafter(name, reference))
    reqs, calls = mtp_runs.interleaved(eng, PROMPTS, NEW)
    check_equal(reqs, reference)
    assert all(c["forwards"] == 1 for c in calls if "decode" in c["call"])  # one verify forward per call
    st = eng.speculator.stats
    if name == "oracle":
        assert st.acceptance_rate == 1.0 and st.tokens_per_step > k  # k + 1 except where max_seq/NEW cut it
    if name == "adversarial":
        assert st.accepted == 0 and st.tokens_per_step == 1.0
    if name == "half":
        assert 0.2 < st.acceptance_rate < 0.8


@pytest.mark.parametrize("rollback", ["replay", "states"])
def test_rolled_back_state_equals_plain_decoding(path, reference, rollback):
    """Speculative steps with partial acceptance leave every slot as plain decoding of its tokens would."""
    eng = engine(path, 3, speculative_rollback=rollback)
    eng.speculator.use(drafter("half", reference))
    reqs, _ = mtp_runs.interleaved(eng, PROMPTS, 20)
    assert_states_equal_plain(path, eng, reqs, reference)


def assert_states_equal_plain(path, eng, reqs, reference):
    """Every slot's tokens are plain greedy decoding's, and its K/V, conv, recurrent and MTP state equal those
    of plain decoding of the same tokens (to rounding: the verify forward batches k+1 tokens)."""
    check = engine(path, 0)
    for r in reqs:
        tokens = eng.cache.slots[r.slot_id].tokens
        assert tokens == reference[r.slot_id][: len(tokens)]
        check.prefill(r.prompt_tokens, slot_id=r.slot_id)
        for t in tokens[len(r.prompt_tokens) :]:
            check.decode_step(t, slot_id=r.slot_id)
        got, want = eng.snapshot(r.slot_id).tensors, check.snapshot(r.slot_id).tensors
        for name, x in want.items():
            torch.testing.assert_close(got[name], x, atol=2e-5, rtol=1e-4, msg=name)


class Ragged(Drafter):
    """Oracle drafts, one fewer for slot 1 at every other position: runs of different lengths in one step."""

    name = "ragged"

    def __init__(self, refs):
        self.oracle = OracleDrafter(dict(enumerate(refs)), accuracy=0.6, seed=5)

    def draft(self, spec, rows):
        drafts = self.oracle.draft(spec, rows)
        for r, d in zip(rows, drafts.tokens, strict=True):
            if r.slot == 1 and r.position % 2:
                del d[-1:]
        return drafts


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("name", ["mtp", "half", "adversarial", "ragged"])
def test_graphed_verify_step_equals_plain(path, reference, name, k):
    """The verify step as replayed from a graph (padded runs, every row rolled back by a second graph) keeps
    greedy output token-identical to plain decoding, and slot states equal to plain decoding's."""
    eng = rerun_graphs(engine(path, k, cuda_graphs=False))
    if name == "ragged":
        eng.speculator.use(Ragged(reference))
    elif name != "mtp":
        eng.speculator.use(drafter(name, reference))
    reqs, _ = mtp_runs.interleaved(eng, PROMPTS, 24)
    for r, ref in zip(reqs, reference, strict=True):
        assert r.generated_tokens[:25] == ref[len(r.prompt_tokens) :][:25], f"slot {r.slot_id}"
    verify = [key for key in eng.graphs.graphs if key[0] == "verify"]
    assert verify and max(key[2] for key in verify) == k + 1  # the steps were replays over the longest run
    assert_states_equal_plain(path, eng, reqs, reference)


def test_graphed_mtp_drafts_equal_eager_drafts(path):
    """The MTP draft replayed from a graph (queued rows, recursive rows and argmaxes on the device) proposes the
    eager loop's tokens from the same logits, step by step, batched and interleaved."""
    traces = []
    for with_graphs in (False, True):
        # prompts eager in both: on CUDA a padded prompt graph rounds its GEMMs otherwise (test_graphs checks those)
        eng = engine(path, 3, cuda_graphs=False, prefill_graph_tokens=0)
        if with_graphs:
            rerun_graphs(eng)
        eng.speculator.drafter.trace = []
        mtp_runs.interleaved(eng, PROMPTS, 16)
        traces.append(eng.speculator.drafter.trace)
    assert any(key[0] == "draft3" for key in eng.graphs.graphs)
    eager, graphed = traces
    assert [(t["draft"], t["slots"], t["positions"], t["tokens"]) for t in graphed] == [
        (t["draft"], t["slots"], t["positions"], t["tokens"]) for t in eager
    ]
    for g, e in zip(graphed, eager, strict=True):
        torch.testing.assert_close(g["logits"], e["logits"], atol=1e-5, rtol=1e-5)


def test_single_slot_results_carry_every_token(path, reference):
    eng = engine(path, 3)
    eng.speculator.use(drafter("oracle", reference))
    r = eng.prefill(PROMPTS[1], slot_id=1)
    assert r.tokens == [r.next_token]
    out = [r.next_token]
    while len(out) < NEW + 1:
        r = eng.decode_step(out[-1], slot_id=1)
        assert r.next_token == r.tokens[-1] and len(r.tokens) == 4 or len(out) + len(r.tokens) > NEW
        assert r.position == len(PROMPTS[1]) + len(out) + len(r.tokens) - 1
        assert r.logits.argmax().item() == r.next_token
        out.extend(r.tokens)
    assert out[: NEW + 1] == reference[1][len(PROMPTS[1]) :][: NEW + 1]


def test_batch_result_lists_and_requests(path, reference):
    eng = engine(path, 2)
    eng.speculator.use(drafter("half", reference))
    reqs = [BatchedRequest(i, p, slot_id=i) for i, p in enumerate(PROMPTS)]
    eng.batch_prefill(reqs)
    before = [list(r.generated_tokens) for r in reqs]
    res = eng.batch_decode_step(reqs)
    for r, b, toks, last, pos in zip(reqs, before, res.tokens, res.next_tokens, res.positions, strict=True):
        assert r.generated_tokens == b + toks and last == toks[-1] == r.last_token
        assert pos == eng.position(r.slot_id) == len(r.prompt_tokens) + len(r.generated_tokens) - 1
    assert res.logits.shape == (3, eng.cfg.vocab_size)


def test_snapshot_restore_carries_the_mtp_state(path, reference):
    """A slot restored elsewhere drafts exactly as the original (MTP KV and hidden-state queue travel along)."""
    eng = engine(path, 2)
    d = eng.speculator.drafter
    r = eng.prefill(PROMPTS[2], slot_id=0)
    toks = [r.next_token]
    for _ in range(5):
        toks.extend(eng.decode_step(toks[-1], slot_id=0).tokens)
    snap = eng.snapshot(0)
    d.trace = []
    a = eng.decode_step(toks[-1], slot_id=0)
    trace_a = d.trace
    eng.restore(snap, slot_id=2)
    d.trace = []
    b = eng.decode_step(toks[-1], slot_id=2)
    assert a.tokens == b.tokens
    assert [t["tokens"] for t in trace_a] == [t["tokens"] for t in d.trace]
    assert torch.equal(torch.cat([t["logits"] for t in trace_a]), torch.cat([t["logits"] for t in d.trace]))


def test_drafts_shrink_at_max_seq_len(path, reference):
    eng = engine(path, 3, max_seq_len=len(PROMPTS[0]) + 10)
    eng.speculator.use(drafter("oracle", reference))
    r = eng.prefill(PROMPTS[0])
    out = [r.next_token]
    while eng.position() < eng.options.max_seq_len:
        out.extend(eng.decode_step(out[-1]).tokens)
    assert eng.position() == eng.options.max_seq_len
    assert out == reference[0][len(PROMPTS[0]) :][: len(out)]
    with pytest.raises(ValueError, match="max_seq_len"):
        eng.decode_step(out[-1])


def test_bad_drafts_are_refused(path):
    class Bad(Drafter):
        def draft(self, spec, rows):
            return Drafts([[10**6] * r.k for r in rows], [None] * len(rows))

    eng = engine(path, 2)
    eng.prefill(PROMPTS[0])
    eng.speculator.use(Bad())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.decode_step(1)
    assert eng.position() == len(PROMPTS[0])

    class Short(Drafter):  # drafts for fewer rows than asked
        def draft(self, spec, rows):
            return Drafts([], [])

    eng.speculator.use(Short())
    with pytest.raises(ValueError, match="drafted for 0 rows, not 1"):
        eng.decode_step(1)
    assert eng.position() == len(PROMPTS[0])


def test_generate_with_speculation(path, reference):
    eng = engine(path, 2)
    out = eng.generate([PROMPTS[0], PROMPTS[2]], SamplingParams(max_new_tokens=20))
    assert out == [reference[0][5:25], reference[2][14:34]]


@pytest.mark.parametrize("name", ["mtp", "half"])
def test_repetition_penalty_under_speculation_is_plain_decodings(path, reference, name):
    """Greedy rows with a repetition penalty (and one without) keep plain penalized decoding's tokens through
    batched and interleaved verify steps; the penalty changes those tokens, so the check can fail."""
    sampling = [SamplingParams(repetition_penalty=1.3), SamplingParams(), SamplingParams(repetition_penalty=0.8)]
    plain, _ = mtp_runs.interleaved(engine(path, 0), PROMPTS, NEW, sampling)
    refs = [r.prompt_tokens + r.generated_tokens for r in plain]
    assert refs[0][: len(reference[0])] != reference[0] and refs[2][: len(reference[2])] != reference[2]
    eng = engine(path, 2)
    if name == "half":
        eng.speculator.use(drafter(name, refs))
    reqs, _ = mtp_runs.interleaved(eng, PROMPTS, NEW, sampling)
    check_equal(reqs, refs)


def test_verify_positions_are_penalized_by_the_tokens_before_them(path):
    """Position j of a verify run follows the slot's tokens and the run's fed tokens up to j (what transformers'
    input_ids would hold there), each row by its own slot; an unpenalized row is left as it is."""
    from pocketlab.sampling import penalize
    from pocketlab.speculative.drafters import Row

    eng = engine(path, 2)
    eng.prefill(PROMPTS[0], slot_id=0)
    eng.prefill(PROMPTS[1], slot_id=1)
    sp = SamplingParams(repetition_penalty=2.0)
    fed = [[7, 8, 9], [10, 11, 12]]
    rows = [Row(s, len(PROMPTS[s]), fed[s][0], sp if s == 0 else SamplingParams(), 2) for s in (0, 1)]
    runs = [Run(s, len(PROMPTS[s]), fed[s]) for s in (0, 1)]
    logits = torch.randn(2, 3, eng.cfg.vocab_size, generator=torch.Generator().manual_seed(0))
    got = eng.speculator._penalized(logits, rows, runs)
    for j in range(3):
        want = penalize(logits[:1, j], [sp], lambda b, j=j: PROMPTS[0] + fed[0][: j + 1])[0]
        assert torch.equal(got[0, j], want) and not torch.equal(want, logits[0, j])
    assert torch.equal(got[1], logits[1])


def test_sampling_is_reproducible_and_batch_independent(path):
    sp = [SamplingParams(temperature=1.0, top_k=5, seed=s) for s in (1, 2, 3)]
    outs = []
    for order in ([0, 1, 2], [2, 0, 1]):
        eng = engine(path, 2)
        reqs = [BatchedRequest(i, PROMPTS[0], slot_id=j, sampling=sp[i]) for j, i in enumerate(order)]
        eng.batch_prefill(reqs)
        for _ in range(6):
            eng.batch_decode_step(reqs)
        outs.append({r.request_id: r.generated_tokens[:7] for r in reqs})
    assert outs[0] == outs[1]
    assert len({tuple(v) for v in outs[0].values()}) > 1


@pytest.mark.skipif(DTYPE != "float32", reason="the chi-square check runs in float32")
def test_sampling_distribution_matches_plain_sampling():
    """Chi-square goodness of fit (alpha = 1e-3, 26 dof, 400 runs each) of the first 3 sampled tokens
    (temperature 1, top-k 3) against their exact joint law under plain sampling, enumerated from the model.
    The MTP drafter exercises the p/q ratio and the max(0, p - q) residual, the oracle (greedy continuation)
    and adversarial drafters the one-hot q; plain sampling checks the check; and the same test must reject
    the law at half the temperature (it has power)."""
    table = mtp_sampling.sampling_check(PRESET, DEVICE, DTYPE, runs=400, alpha=1e-3)
    print(table.to_string())
    assert table["pass"].all()
    for name in ("mtp", "oracle"):
        row = table[table.drafter == name].iloc[0]
        assert 0 < row.accepted < row.drafted  # both acceptance and rejection were exercised


def test_a_failing_capture_falls_back_to_eager_steps(path, reference):
    eng = engine(path, 2, cuda_graphs=False)
    eng.graphs = FailingGraphs(eng.model, eng.cache, eng.options)
    eng.speculator.use(drafter("half", reference))
    with pytest.warns(RuntimeWarning, match="runs eagerly"):
        reqs, _ = mtp_runs.interleaved(eng, PROMPTS, 12)
    for r, ref in zip(reqs, reference, strict=True):
        assert r.generated_tokens[:13] == ref[len(r.prompt_tokens) :][:13]
    assert eng.graphs.failed and not eng.graphs.graphs
