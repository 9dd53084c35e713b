"""CUDA-graph bookkeeping checked on the CPU: test doubles whose "graphs" re-run the captured function (or
fail to capture), so static buffers, padding, buckets and the eager fallback run for real without a GPU."""

import functools

import pytest
import torch
from conftest import DEVICE, LOGIT_TOL, random_prompt

from pocketlab import BatchedRequest
from pocketlab.forward import Run
from pocketlab.graphs import StaticInputs, key_buckets
from pocketlab.sampling import GREEDY, SamplingParams, sample
from pocketlab.verify.graph_doubles import RerunGraphs, rerun_graphs


class FailingGraphs(RerunGraphs):
    """Every capture fails, as a CUDA capture might."""

    def record(self, fn):
        raise RuntimeError("operation failed due to a previous error during capture")


class FlakyGraphs(RerunGraphs):
    """The first capture fails the way a real one does: inside, after taking the engine's pool."""

    pools_seen: list

    def record(self, fn):
        self.pools_seen = getattr(self, "pools_seen", []) + [self.pool]
        if len(self.pools_seen) == 1:
            self.pool = object()  # as record() takes torch.cuda.graph_pool_handle()
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
        return super().record(fn)


# a request that draws its tokens among greedy ones: the graph's argmax must not stand in for its draws
DRAWN = SamplingParams(temperature=1.0, seed=5)


def batch_decode(eng, prompts, steps, sampling=None):
    sampling = sampling or [GREEDY] * len(prompts)
    reqs = [BatchedRequest(i, p, sampling=sp) for i, (p, sp) in enumerate(zip(prompts, sampling, strict=True))]
    eng.batch_prefill(reqs)
    logits = [eng.batch_decode_step(reqs).logits for _ in range(steps)]
    return [r.generated_tokens for r in reqs], torch.stack(logits)


@pytest.mark.parametrize("sampling", [(GREEDY,) * 3, (GREEDY, DRAWN, GREEDY)], ids=["greedy", "one-drawn"])
@pytest.mark.parametrize("graphs", [RerunGraphs, FailingGraphs, "cuda"])
def test_graphed_decode_equals_eager(make_engine, graphs, sampling):
    """Batch decode steps through the graph path (3 slots in the 4-row bucket: one filler row on the scratch
    slot; keys crossing from the 128 to the 160 bucket), or through its eager fallback, give eager decoding's
    tokens and logits: all greedy (the graph's own argmax, read back ahead of the logits), and with one row
    drawing its tokens. `cuda`: real captures (POCKETLAB_DEVICE=cuda) against an engine without graphs."""
    prompts = [random_prompt(n, seed=40 + n) for n in (3, 9, 115)]
    decode_only = dict(max_slots=4, max_seq_len=160, prefill_graph_tokens=0)  # prompt graphs: test_graphed_prompts_*
    if graphs == "cuda" and DEVICE != "cuda":
        pytest.skip("real CUDA graphs: POCKETLAB_DEVICE=cuda")
    want = batch_decode(make_engine("tiny-qwen3_5", cuda_graphs=False, **decode_only), prompts, 20, sampling)
    eng = make_engine("tiny-qwen3_5", decode_ahead=True, **decode_only)
    if graphs != "cuda":
        eng.graphs = graphs(eng.model, eng.cache, eng.options)
    if graphs is FailingGraphs:
        with pytest.warns(RuntimeWarning, match="runs eagerly"):
            got = batch_decode(eng, prompts, 20, sampling)
        assert eng.graphs.failed and not eng.graphs.graphs
    else:
        got = batch_decode(eng, prompts, 20, sampling)
        # all greedy: from the first step on, each step is the one the step before launched ahead (decode_ahead),
        # from graphs of its own whose Gated DeltaNet layers store their states aside
        aside = all(sp.greedy for sp in sampling)
        later = {("decode_aside", 4, 1, 128), ("decode_aside", 4, 1, 160)} if aside else {("decode", 4, 1, 160)}
        assert set(eng.graphs.graphs) == {("decode", 4, 1, 128)} | later
    assert got[0] == want[0]
    torch.testing.assert_close(got[1], want[1], atol=LOGIT_TOL, rtol=0)  # a 4-row matmul rounds differently
    for i, (prompt, sp) in enumerate(zip(prompts, sampling, strict=True)):  # each token: its own logits' draw
        drawn = [sample(got[1][k, i][None], [sp], [len(prompt) + k + 1]).item() for k in range(20)]
        assert got[0][i][1:] == drawn


def test_a_retried_capture_takes_a_fresh_pool(make_engine):
    """After a capture fails inside, its pool may still be taking allocations: the retry must not capture into
    it (on the GPU that retry fails with "already recording to mempool_id" and the shape runs eagerly)."""
    eng = make_engine("tiny-qwen3", max_slots=2, max_seq_len=128)
    eng.graphs = FlakyGraphs(eng.model, eng.cache, eng.options)
    with pytest.warns(RuntimeWarning, match="retrying"):
        batch_decode(eng, [random_prompt(5, seed=1)], 2)
    assert eng.graphs.pools_seen[:2] == [None, None] and not eng.graphs.failed
    assert ("decode", 1, 1, 128) in eng.graphs.graphs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a host-to-device copy that can still be pending: CUDA")
def test_inputs_loaded_twice_before_the_gpu_reads_them_reach_it_in_order():
    """A replay's inputs go to the GPU from a pinned host buffer without waiting: loading the next step's into that
    buffer must wait until the GPU has read the last one (two prompt chunks can replay one graph back to back)."""
    inputs = StaticInputs.allocate(2, 1, scratch_slot=7, device="cuda")
    seen = []
    for token in (11, 22):
        torch.cuda._sleep(50_000_000)  # the GPU busy for a while, so the copy is still queued when load returns
        inputs.load([Run(3, 40, [token])], scratch_slot=7, real_lengths=False)
        seen.append(inputs.buffer.clone())  # what a replay enqueued now would read
    torch.cuda.synchronize()
    want = [[[token, 0], [3, 7], [40, 0], [1, 1]] for token in (11, 22)]
    assert [s.tolist() for s in seen] == want


def test_key_buckets_double_up_to_the_context():
    assert key_buckets(160) == [128, 160] and key_buckets(1000) == [128, 256, 512, 1000]


def graphed(make_engine, preset="tiny-qwen3", **options):
    """An engine whose graphs are RerunGraphs (on the CPU, where it would have none)."""
    return rerun_graphs(make_engine(preset, cuda_graphs=False, **options))


def prompts_then_decode(eng, lengths=(5, 40, 20, 50, 60, 70, 250)):
    """Prompt calls that prompt graphs take or leave (prefill_chunk 32, 256 positions, hybrid checkpoints every 48),
    then two decode steps of all four slots: (tokens, logits) of every call."""
    p = [random_prompt(n, seed=70 + n) for n in lengths]
    results = [eng.prefill(p[0], slot_id=0), eng.prefill(p[0] + p[1][:12], slot_id=0)]
    assert results[1].reused_tokens == len(p[0])  # 12 tokens from position 5
    results.append(eng.prefill(p[1], slot_id=1))  # 40 tokens: 32, then 8 from position 32
    # four ragged rows: the 32 bucket twice in one batch bucket (four rows, then three), the last row's tail alone
    requests = [BatchedRequest(i, q, slot_id=i) for i, q in enumerate(p[2:6])]
    results += eng.batch_prefill(requests).results
    if len(p) > 6:
        results.append(eng.prefill(p[6], slot_id=2))  # the last piece's bucket reaches the context's end exactly
        results.append(eng.prefill(p[6] + [1, 2, 3], slot_id=2))  # 3 tokens at 250: past it, so eager
        requests[2].generated_tokens = [results[-1].next_token]
    tokens, logits = [r.next_token for r in results], [r.logits for r in results]
    for _ in range(2):
        step = eng.batch_decode_step(requests)
        tokens, logits = tokens + step.next_tokens, logits + list(step.logits)
    return tokens, torch.stack(logits)


PROMPT_GRAPHS = dict(max_slots=4, max_seq_len=256, prefill_chunk=32, checkpoint_stride=48, prefill_graph_tokens=128)
EAGER_PROMPTS = PROMPT_GRAPHS | dict(prefill_graph_tokens=0)


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3_5", "tiny-qwen3_5_moe"])
@pytest.mark.parametrize("cuda", [False, True], ids=["rerun", "cuda"])
def test_graphed_prompts_equal_eager(make_engine, preset, cuda):
    """Prompt forwards of at most 128 padded tokens (rows x token bucket) replay graphs, rows padded to the bucket and
    masked by their lengths: single prompts, a resumed one, ragged batches whose pieces reuse one graph, pieces up
    to the context's end. A piece whose bucket would pass the end, or (hybrid) that hands back checkpoints, runs
    eagerly. Every call's logits and the decode steps after them match prompts run eagerly. `cuda`: real captures
    (POCKETLAB_DEVICE=cuda), every one of which must succeed."""
    if cuda and DEVICE != "cuda":
        pytest.skip("real CUDA graphs: POCKETLAB_DEVICE=cuda")
    make = functools.partial(make_engine, preset) if cuda else functools.partial(graphed, make_engine, preset)
    want = prompts_then_decode(make(**EAGER_PROMPTS))
    eng = make(**PROMPT_GRAPHS)
    got = prompts_then_decode(eng)
    prompt_keys = {k[1:] for k in eng.graphs.graphs if k[0] == "prefill"}
    assert prompt_keys == {(1, 16, 128), (1, 32, 128), (4, 32, 128), (1, 32, 256)} and not eng.graphs.failed
    assert got[0] == want[0]
    torch.testing.assert_close(got[1], want[1], atol=LOGIT_TOL, rtol=0)


def test_graphed_prompts_in_batch_invariant_mode_are_bitwise_eager(make_engine):
    """The batch-invariant kernels compute each row as alone whatever its padding: a prompt graph's logits are the
    eager prompt's, bit for bit."""
    lengths, invariant = (5, 40, 20, 9, 30, 33), dict(batch_invariant=True)
    want = prompts_then_decode(graphed(make_engine, "tiny-qwen3_5", **EAGER_PROMPTS | invariant), lengths)
    got = prompts_then_decode(graphed(make_engine, "tiny-qwen3_5", **PROMPT_GRAPHS | invariant), lengths)
    assert got[0] == want[0] and torch.equal(got[1], want[1])


def test_graphed_prompts_feed_the_drafter_as_eager_prompts_do(make_engine):
    """With MTP drafts the drafter sees every row of a graphed prompt forward, padding cut off, as of an eager one:
    its drafts after those prompts (tokens and logits, draft by draft) are the eager engine's. (Greedy output
    would hide a wrong draft: verification keeps it exact.)"""
    traces = []
    for options in (EAGER_PROMPTS, PROMPT_GRAPHS):
        eng = graphed(make_engine, "tiny-qwen3_5-mtp", speculative_tokens=2, **options)
        eng.speculator.drafter.trace = []
        prompts_then_decode(eng, lengths=(5, 40, 20, 9, 30, 33))
        traces.append(eng.speculator.drafter.trace)
    assert any(key[0] == "prefill" for key in eng.graphs.graphs)
    eager, replayed = ([(t["draft"], t["slots"], t["positions"], t["tokens"]) for t in trace] for trace in traces)
    assert replayed == eager and eager
    for g, e in zip(*traces, strict=True):
        torch.testing.assert_close(g["logits"], e["logits"], atol=1e-5, rtol=1e-5)
