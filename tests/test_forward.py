"""ForwardContext (batch tensors, the attention path and shared tensors `prepare` picks) and the static input
buffers of CUDA-graph steps, checked on small hand-made batches."""

import pytest
import torch

from pocketlab.forward import AttentionPath, ForwardContext, Run
from pocketlab.graphs import StaticInputs
from pocketlab.layers.rotary import Rotary
from pocketlab.requests import BatchedRequest

ROTARY = Rotary(8, 10000.0, 32, "cpu", torch.float32)
SCRATCH = 7


def test_build_pads_runs_and_prepare_routes_padding_to_the_scratch_slot():
    ctx = ForwardContext.build([Run(2, 5, [1, 2, 3]), Run(0, 0, [4])], SCRATCH, "cpu", checkpoints=[(0, 2)])
    assert ctx.tokens.tolist() == [[1, 2, 3], [4, 0, 0]] and ctx.lengths.tolist() == [3, 1] and ctx.kv_len == 8
    assert ctx.checkpoint_states == {(0, 2): {}}  # one output per request, filled by the linear layers
    ctx.prepare(ROTARY, decode_kernel=True)  # T = 3: the decode kernel does not apply
    assert ctx.attention is AttentionPath.MASKED and ctx.kv_lengths is None
    assert ctx.positions.tolist() == [[5, 6, 7], [0, 0, 0]]  # padding repeats the last real position
    slots, positions = ctx.kv_targets
    assert slots.tolist() == [[2, 2, 2], [0, SCRATCH, SCRATCH]] and positions.tolist() == [[5, 6, 7], [0, 1, 2]]
    assert ctx.mask.shape == (2, 1, 3, 8) and ctx.mask[0, 0, 0].tolist() == [True] * 6 + [False] * 2
    torch.testing.assert_close(ctx.rope[0], ROTARY.cos[ctx.positions].unsqueeze(2), rtol=0, atol=0)


def test_prepare_picks_the_attention_path():
    fresh = ForwardContext.build([Run(1, 0, [3, 4, 5])], SCRATCH, "cpu")
    fresh.prepare(ROTARY, decode_kernel=True)
    assert fresh.attention is AttentionPath.CAUSAL and fresh.mask is None and fresh.kv_targets is not None
    step = ForwardContext.build([Run(1, 4, [3]), Run(0, 9, [6])], SCRATCH, "cpu")
    step.prepare(ROTARY, decode_kernel=True)
    assert step.attention is AttentionPath.DECODE_KERNEL and step.kv_lengths.tolist() == [5, 10]
    assert step.kv_targets is None and step.mask is None  # the kernel writes K/V itself
    assert step.rope is None and step.rotary is ROTARY and step.positions.tolist() == [[4], [9]]  # rows it reads
    step.prepare(ROTARY, decode_kernel=False)
    assert step.attention is AttentionPath.MASKED and step.kv_lengths is None and step.mask.shape == (2, 1, 1, 10)


def test_build_says_whether_any_run_is_padded():
    assert ForwardContext.build([Run(2, 5, [1, 2, 3]), Run(0, 0, [4])], SCRATCH, "cpu").padded
    assert not ForwardContext.build([Run(2, 5, [1, 2]), Run(0, 0, [4, 6])], SCRATCH, "cpu").padded
    assert not ForwardContext.build([Run(1, 0, [3])], SCRATCH, "cpu").padded


def test_an_unpadded_hybrid_prefill_skips_its_masks_and_changes_no_bit(make_engine, monkeypatch):
    """Equal-length runs skip the Gated DeltaNet padding masks (padded=False); forcing the masks on must give
    the same logits and states bit for bit, through prefix-cache checkpoint segments and prefill chunks too."""
    prompts = [[5, 9, 2, 7, 1, 3, 8, 4, 6, 2, 11, 13], [4, 4, 1, 8, 2, 9, 6, 3, 7, 5, 10, 12]]
    build, seen = ForwardContext.build.__func__, []

    def run(force_masks: bool):
        def spied(cls, *args, **kwargs):
            ctx = build(cls, *args, **kwargs)
            seen.append(ctx.padded)
            ctx.padded = ctx.padded or force_masks
            return ctx

        monkeypatch.setattr(ForwardContext, "build", classmethod(spied))
        eng = make_engine("tiny-qwen3_5", checkpoint_stride=4, prefill_chunk=8)
        eng.allocate_batch_slots(2)
        logits = [r.logits for r in eng.batch_prefill([BatchedRequest(i, p) for i, p in enumerate(prompts)]).results]
        return logits, [eng.snapshot(s).tensors for s in (0, 1)]

    skipped = run(force_masks=False)
    assert seen and not any(seen)  # every forward of equal-length runs skipped the masks
    masked = run(force_masks=True)
    for a, b in zip(skipped[0], masked[0], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(skipped[1], masked[1], strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_build_rejects_empty_runs():
    with pytest.raises(ValueError, match="at least one"):
        ForwardContext.build([], SCRATCH, "cpu")
    with pytest.raises(ValueError, match="at least one token"):
        ForwardContext.build([Run(0, 0, [1]), Run(1, 3, [])], SCRATCH, "cpu")


def test_static_inputs_are_named_views_of_one_buffer():
    inputs = StaticInputs.allocate(4, 3, SCRATCH, "cpu")
    for view in (inputs.tokens, inputs.slot_ids, inputs.start, inputs.lengths):
        assert view.untyped_storage().data_ptr() == inputs.buffer.untyped_storage().data_ptr()
    assert inputs.slot_ids.tolist() == [SCRATCH] * 4 and inputs.lengths.tolist() == [3] * 4
    inputs.load([Run(1, 10, [5, 6]), Run(2, 20, [7, 8, 9])], SCRATCH, real_lengths=True)
    assert inputs.tokens.tolist() == [[5, 6, 0], [7, 8, 9], [0, 0, 0], [0, 0, 0]]
    assert inputs.slot_ids.tolist() == [1, 2, SCRATCH, SCRATCH] and inputs.start.tolist() == [10, 20, 0, 0]
    assert inputs.lengths.tolist() == [2, 3, 3, 3]
    inputs.load([Run(1, 10, [5, 6])], SCRATCH, real_lengths=False)  # padding counted as real
    assert inputs.lengths.tolist() == [3] * 4
    ctx = inputs.context(kv_len=128, scratch_slot=SCRATCH)
    assert ctx.tokens is inputs.tokens and ctx.kv_len == 128  # a captured graph reads the buffer itself
    with pytest.raises(ValueError, match="at most 4 runs of 3"):
        inputs.load([Run(0, 0, [1, 2, 3, 4])], SCRATCH, real_lengths=True)
