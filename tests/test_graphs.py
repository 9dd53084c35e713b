"""CUDA-graph bookkeeping checked on the CPU: test doubles whose "graphs" re-run the captured function (or
fail to capture), so static buffers, padding, buckets and the eager fallback run for real without a GPU."""

from types import SimpleNamespace

import pytest
import torch
from conftest import LOGIT_TOL, random_prompt

from pocketlab import BatchedRequest
from pocketlab.graphs import StepGraphs, key_buckets


def _copy_into(dst, src):
    """Write what a re-run returned into the objects the capture returned (tensors in place, recursively)."""
    if src is None or isinstance(dst, (int, float, str)):
        return
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, (list, tuple)):
        for a, b in zip(dst, src, strict=True):
            _copy_into(a, b)
    elif isinstance(dst, dict):
        for key in dst:
            _copy_into(dst[key], src[key])
    elif hasattr(dst, "__dict__"):
        for key, value in vars(dst).items():
            _copy_into(value, getattr(src, key, None))


class RerunGraphs(StepGraphs):
    """StepGraphs whose 'graph' re-runs the captured function and writes its results into the outputs of the
    capture. Everything around the CUDA graph runs for real on the CPU: static input buffers, padding of
    shorter runs, bucket choice, the rollback graph restoring every row (the GPU run checks the capture)."""

    def record(self, fn):
        out = fn()  # the warm-up run; a real capture records without running
        return SimpleNamespace(replay=lambda: _copy_into(out, fn())), out


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


def batch_decode(eng, prompts, steps):
    reqs = [BatchedRequest(i, p) for i, p in enumerate(prompts)]
    eng.batch_prefill(reqs)
    logits = [eng.batch_decode_step(reqs).logits for _ in range(steps)]
    return [r.generated_tokens for r in reqs], torch.stack(logits)


@pytest.mark.parametrize("graphs", [RerunGraphs, FailingGraphs])
def test_graphed_decode_equals_eager(make_engine, graphs):
    """Batch decode steps through the graph path (3 slots in the 4-row bucket: one filler row on the scratch
    slot; keys crossing from the 128 to the 160 bucket), or through its eager fallback, give eager decoding's
    tokens and logits."""
    prompts = [random_prompt(n, seed=40 + n) for n in (3, 9, 115)]
    want = batch_decode(make_engine("tiny-qwen3_5", max_slots=4, max_seq_len=160), prompts, 20)
    eng = make_engine("tiny-qwen3_5", max_slots=4, max_seq_len=160)
    eng.graphs = graphs(eng.model, eng.cache, eng.options)
    if graphs is FailingGraphs:
        with pytest.warns(RuntimeWarning, match="runs eagerly"):
            got = batch_decode(eng, prompts, 20)
        assert eng.graphs.failed and not eng.graphs.graphs
    else:
        got = batch_decode(eng, prompts, 20)
        assert set(eng.graphs.graphs) == {("decode", 4, 1, 128), ("decode", 4, 1, 160)}
    assert got[0] == want[0]
    torch.testing.assert_close(got[1], want[1], atol=LOGIT_TOL, rtol=0)  # a 4-row matmul rounds differently


def test_a_retried_capture_takes_a_fresh_pool(make_engine):
    """After a capture fails inside, its pool may still be taking allocations: the retry must not capture into
    it (on the GPU that retry fails with "already recording to mempool_id" and the shape runs eagerly)."""
    eng = make_engine("tiny-qwen3", max_slots=2, max_seq_len=128)
    eng.graphs = FlakyGraphs(eng.model, eng.cache, eng.options)
    with pytest.warns(RuntimeWarning, match="retrying"):
        batch_decode(eng, [random_prompt(5, seed=1)], 2)
    assert eng.graphs.pools_seen[:2] == [None, None] and not eng.graphs.failed
    assert ("decode", 1, 1, 128) in eng.graphs.graphs


def test_key_buckets_double_up_to_the_context():
    assert key_buckets(160) == [128, 160] and key_buckets(1000) == [128, 256, 512, 1000]
