"""Memory planning: the plan counts exactly the bytes the engine allocates for weights and slot caches, a device too
small is refused before any weight is read, with the numbers and the largest max_slots / max_seq_len that fit (and
those do fit), and max_slots="auto" takes the most slots that fit."""

import pytest

from pocketlab import EngineOptions, ModelConfig, QwenEngine, memory
from pocketlab.loader import load_weights

OPTS = dict(max_slots=4, max_seq_len=128, prefix_cache_bytes=1 << 20, memory_fraction=1.0)


def cache_bytes(eng) -> int:
    c = eng.cache
    return sum(t.numel() * t.element_size() for bank in (c.k, c.v, c.conv, c.rec, c.extra) for t in bank.values())


@pytest.mark.parametrize(
    "preset, extra", [("tiny-qwen3", {}), ("tiny-qwen3_5", {}), ("tiny-qwen3_5-mtp", {"speculative_tokens": 2})]
)
def test_plan_counts_what_the_engine_allocates(checkpoint, preset, extra):
    path = checkpoint(preset)
    eng = QwenEngine.from_pretrained(path, EngineOptions(**OPTS, **extra))
    cfg = ModelConfig.from_pretrained(path)
    plan = memory.plan(cfg, eng.options, free=1 << 40)
    assert plan.slot_caches == cache_bytes(eng)
    assert plan.weights == sum(t.numel() * t.element_size() for t in load_weights(path, cfg).values())


@pytest.fixture
def small_device(checkpoint, monkeypatch):
    """A pretend device with room for exactly 3 of 4 slots (free memory is injected, as a test must)."""
    path = checkpoint("tiny-qwen3_5")
    cfg = ModelConfig.from_pretrained(path)
    free = memory.plan(cfg, EngineOptions(**OPTS | dict(max_slots=3)), free=0).total
    monkeypatch.setattr(memory, "device_free_bytes", lambda device: free)
    return path, free


def test_a_config_that_does_not_fit_is_refused_with_the_numbers(small_device, monkeypatch):
    path, free = small_device
    monkeypatch.setattr("pocketlab.engine.load_weights", lambda *a: pytest.fail("weights read before the plan"))
    with pytest.raises(ValueError, match="does not fit") as e:
        QwenEngine.from_pretrained(path, EngineOptions(**OPTS))
    message = str(e.value)
    assert "4 slots + 1 scratch" in message and "weights" in message and memory.gib(free) in message
    assert "max_slots=3 at max_seq_len=128" in message  # the largest that fit, and they do:
    seq = int(message.split("max_seq_len=")[-1].split(" ")[0])
    assert 2 <= seq < 128


def test_the_suggested_configs_fit(small_device):
    path, _ = small_device
    assert QwenEngine.from_pretrained(path, EngineOptions(**OPTS | dict(max_slots=3))).num_slots == 3
    with pytest.raises(ValueError) as e:
        QwenEngine.from_pretrained(path, EngineOptions(**OPTS))
    seq = int(str(e.value).split("max_seq_len=")[-1].split(" ")[0])
    QwenEngine.from_pretrained(path, EngineOptions(**OPTS | dict(max_seq_len=seq)))
    with pytest.raises(ValueError, match="does not fit"):
        QwenEngine.from_pretrained(path, EngineOptions(**OPTS | dict(max_seq_len=seq + 1)))


def test_auto_takes_the_most_slots_that_fit(small_device):
    path, free = small_device
    eng = QwenEngine.from_pretrained(path, EngineOptions(**OPTS | dict(max_slots="auto")))
    assert eng.num_slots == eng.options.max_slots == eng.options.slot_count == 3
    with pytest.raises(ValueError, match="not resolved yet"):  # a count is never read off an unresolved "auto"
        _ = EngineOptions(max_slots="auto").slot_count
    eng.prefill([1, 2, 3], slot_id=2)
    fraction = 1 - 1.5 * eng.memory.per_slot / free  # a slot and a half less
    fewer = QwenEngine.from_pretrained(path, EngineOptions(**OPTS | dict(max_slots="auto", memory_fraction=fraction)))
    assert 1 <= fewer.num_slots < 3


def test_nothing_fits(checkpoint, monkeypatch):
    monkeypatch.setattr(memory, "device_free_bytes", lambda device: 1000)
    with pytest.raises(ValueError, match="not even one slot fits"):
        QwenEngine.from_pretrained(checkpoint("tiny-qwen3"), EngineOptions(**OPTS | dict(max_slots="auto")))
    with pytest.raises(ValueError, match="Even one slot"):
        QwenEngine.from_pretrained(checkpoint("tiny-qwen3"), EngineOptions(**OPTS))


@pytest.mark.parametrize("bad", [dict(max_slots="many"), dict(max_slots=0), dict(memory_fraction=1.5)])
def test_bad_memory_options(bad):
    with pytest.raises(ValueError):
        EngineOptions(**bad)


def test_prompt_graphs_are_planned(checkpoint):
    """On CUDA the graph pool also keeps the forward of the largest prompt graph and every prompt graph's output."""
    cfg = ModelConfig.from_pretrained(checkpoint("tiny-qwen3"))
    options = dict(OPTS, device="cuda")
    pool = [memory.plan(cfg, EngineOptions(**options, prefill_graph_tokens=n), free=1 << 40).graphs for n in (0, 8, 64)]
    assert pool[0] == pool[1] < pool[2]  # below the smallest token bucket (16) there is no prompt graph
