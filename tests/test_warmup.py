"""Warm-up: after engine.warmup() no call captures a graph, and the engine computes exactly as a fresh one.

Graph capture runs on the CPU through pocketlab.verify.graph_doubles.RerunGraphs (the GPU run checks real captures and
the compile counters of inductor and Triton)."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import random_prompt
from test_graphs import graphed

from pocketlab import BatchedRequest, SamplingParams, kernel_cache
from pocketlab.graphs import key_buckets
from pocketlab.warmup import graph_steps, prompt_shapes


def serve(eng, prompts, new_tokens):
    """generate() over ragged prompts: slots fill and free, batches shrink, keys cross buckets."""
    sampling = [SamplingParams(max_new_tokens=n) for n in new_tokens]
    return eng.generate(prompts, sampling)


PROMPTS = [random_prompt(n, seed=60 + n) for n in (3, 40, 90, 7, 120, 1)]
NEW = [130, 20, 60, 150, 9, 100]  # positions cross the 128 key bucket into the 256 one


def test_after_warmup_no_call_captures_and_outputs_equal_a_fresh_engine(make_engine):
    """Every (batch bucket, key bucket) decode graph is captured by warm-up (and any prompt graph the options ask for),
    none later while generate() runs batches of 1..4 over keys crossing buckets; warm-up leaves the engine as fresh
    (same tokens as an engine that never warmed up, prefix cache empty, forward count unchanged)."""
    want = serve(graphed(make_engine, max_slots=4), PROMPTS, NEW)
    eng = graphed(make_engine, max_slots=4)
    report = eng.warmup(progress=False)
    buckets = {(b, kv) for b in (1, 2, 4) for kv in key_buckets(256)}
    assert {(k[1], k[3]) for k in eng.graphs.graphs if k[0] == "decode"} == buckets
    assert report.graphs == len(eng.graphs.graphs) and report.failed == 0 and report.prompts == len(prompt_shapes(eng))
    assert eng.forward_count == 0 and not eng.prefix.entries and eng.free_slots() == [0, 1, 2, 3]
    captures = eng.graphs.captures
    assert serve(eng, PROMPTS, NEW) == want
    assert eng.graphs.captures == captures, "a call captured a graph after warm-up"


def test_warmup_captures_every_prompt_graph(make_engine):
    """With prefill_graph_tokens=64, a prompt graph per batch bucket, token bucket (rows x tokens <= 64) and key
    bucket; generate() replays them (an engine without warm-up captures some as it goes) and captures nothing."""
    options = dict(max_slots=4, prefill_graph_tokens=64)
    fresh = graphed(make_engine, **options)
    want = serve(fresh, PROMPTS, NEW)
    eng = graphed(make_engine, **options)
    eager, forward = [], eng._forward
    eng._forward = lambda *a: eager.append(1) or forward(*a)
    report = eng.warmup(progress=False)
    shapes = [(1, 16), (1, 32), (1, 64), (2, 16), (2, 32), (4, 16)]
    prompt_keys = {("prefill", b, T, kv) for b, T in shapes for kv in key_buckets(256)}
    assert {k for k in eng.graphs.graphs if k[0] == "prefill"} == prompt_keys
    assert len(eager) >= report.prompts  # its prompts ran eagerly: a piece no graph takes needs their kernels
    assert report.graphs == len(graph_steps(eng)) == len(prompt_keys) + 3 * len(key_buckets(256))
    assert {k for k in fresh.graphs.graphs if k[0] == "prefill"}, "generate() replayed no prompt graph"
    captures = eng.graphs.captures
    assert serve(eng, PROMPTS, NEW) == want
    assert eng.graphs.captures == captures, "a call captured a graph after warm-up"


def test_speculative_warmup_captures_verify_rollback_and_draft_graphs(make_engine):
    """With an MTP head and k drafts: verify graphs (and their rollback graphs) and a draft graph per queue
    length 1..k+1 at every bucket; speculative generate() then captures nothing and keeps its tokens."""
    prompts, new = PROMPTS[:3], [40, 12, 60]  # the last crosses into the 256 key bucket
    want = serve(graphed(make_engine, "tiny-qwen3_5-mtp", max_slots=2, speculative_tokens=2), prompts, new)
    eng = graphed(make_engine, "tiny-qwen3_5-mtp", max_slots=2, speculative_tokens=2)
    eng.warmup(progress=False)
    names = {k[:3] for k in eng.graphs.graphs}
    assert {("verify", b, 3) for b in (1, 2)} | {("draft2", b, q) for b in (1, 2) for q in (1, 2, 3)} <= names
    assert all(run.outputs.graphed for key, run in eng.graphs.graphs.items() if key[0] == "verify")
    captures = eng.graphs.captures
    assert serve(eng, prompts, new) == want
    assert eng.graphs.captures == captures, "a speculative call captured a graph after warm-up"
    assert eng.speculator.stats.steps > 0


def test_warmup_refuses_a_busy_engine_and_leaves_it_as_it_was(make_engine):
    eng = graphed(make_engine)
    eng.prefill(random_prompt(9, seed=1), slot_id=1)  # with prefill_graph_tokens its prompt replays a graph
    graphs = set(eng.graphs.graphs)
    with pytest.raises(ValueError, match="idle engine"):
        eng.warmup(progress=False)
    assert eng.position(1) == 9 and set(eng.graphs.graphs) == graphs
    eng.reset()
    req = BatchedRequest(0, [1, 2])
    eng.batch_prefill([req])  # allocated, then released: still busy while allocated
    with pytest.raises(ValueError, match="idle engine"):
        eng.warmup(progress=False)


def test_warmup_option_runs_at_construction(make_engine):
    """EngineOptions(warmup=True): the report is there and every slot is free; every graph step is warmed (none
    on the CPU) and every prompt shape run, one of them a full prefill chunk."""
    eng = make_engine("tiny-qwen3_5", warmup=True, max_slots=2, prefill_chunk=32)
    assert eng.warmup_report is not None and eng.warmup_report.graphs == len(graph_steps(eng))
    assert eng.warmup_report.prompts == len(prompt_shapes(eng))
    assert [32] in prompt_shapes(eng) and [17, 5] in prompt_shapes(eng)
    assert eng.free_slots() == [0, 1] and (eng.graphs is not None or graph_steps(eng) == [])


def test_kernel_caches_go_to_one_folder_unless_the_environment_says_otherwise(tmp_path):
    """POCKETLAB_CACHE moves every cache; a variable the user set wins; the autotune-result cache is on. (A fresh
    process loads the module alone: the variables must be set before anything reads them.)"""
    code = (
        "import importlib.util as u, os, sys; s = u.spec_from_file_location('kc', sys.argv[1]); "
        "s.loader.exec_module(u.module_from_spec(s)); "
        "print(*(os.environ[k] for k in ('TRITON_CACHE_DIR', 'TORCHINDUCTOR_CACHE_DIR', 'TRITON_CACHE_AUTOTUNING')))"
    )
    env = {k: v for k, v in os.environ.items() if k not in kernel_cache.settings(tmp_path)}
    env |= dict(POCKETLAB_CACHE=str(tmp_path), TRITON_CACHE_DIR="/elsewhere")
    out = subprocess.run(
        [sys.executable, "-c", code, kernel_cache.__file__], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["/elsewhere", str(tmp_path / "inductor"), "1"]


def test_compile_events_count_torch_compile_graphs():
    """The counter warm-up's promise is read from: a new compiled graph moves it, a cached call does not."""
    from pocketlab import compile_events

    f = torch.compile(lambda x: x * 3 - 1, backend="eager")
    before = compile_events.counts()
    f(torch.ones(3))
    middle = compile_events.since(before)
    f(torch.ones(3))
    assert middle["compiled_graphs"] == 1 and compile_events.since(before)["compiled_graphs"] == 1


@pytest.mark.parametrize("fused_linear", ["torch", "auto"])
def test_gpu_decode_graphs_hold_no_torch_compile_graph(make_engine, fused_linear):
    """On CUDA the default kernels run decode's norms, gates and expert sums as Triton kernels: capturing a decode graph
    compiles no torch.compile graph, which a new process would trace again before its first decode step even with
    the disk cache warm. With fused_linear="torch" the same captures do compile (the counter can move)."""
    if not torch.cuda.is_available():
        pytest.skip("torch.compile runs only on CUDA tensors (layers.fused)")
    from pocketlab import compile_events

    for preset in ("tiny-qwen3", "tiny-qwen3_5", "tiny-qwen3_5_moe"):
        torch._dynamo.reset()  # graphs compiled before (other tests, other presets) would hide this one's
        eng = make_engine(preset, device="cuda", fused_linear=fused_linear)
        before = compile_events.counts()
        for rows in (1, 2):
            requests = [BatchedRequest(i, random_prompt(9, seed=i)) for i in range(rows)]
            eng.batch_prefill(requests)
            for _ in range(3):
                eng.batch_decode_step(requests)
            eng.reset()
        compiled = compile_events.since(before)["compiled_graphs"]
        assert (compiled == 0) == (fused_linear == "auto"), (preset, fused_linear, compiled)
