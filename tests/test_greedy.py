"""The one-launch float32 logits and argmax of a decode graph against torch's copy and argmax (GPU, or Triton's CPU
interpreter): the same floats, and torch.argmax's token wherever the largest value repeats or a NaN appears."""

import os

import pytest
import torch

from pocketlab.layers import greedy

on_gpu = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(
    greedy.triton is None or not (on_gpu or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs Triton on a GPU (or TRITON_INTERPRET=1)",
)
DEVICE = "cuda" if on_gpu else "cpu"


def rows_with_ties(vocab: int) -> torch.Tensor:
    """bf16 rows whose largest value repeats: within a block, across blocks (the first in a later block than some
    smaller maxima), in the last partial block, at -inf everywhere, and behind NaNs (one, and two in two blocks)."""
    B = greedy.BLOCK
    x = torch.randn(9, vocab, generator=torch.Generator().manual_seed(vocab)).to(torch.bfloat16)
    x[0, [5, 9, B - 1]] = 8.0  # ties in the first block
    x[1, [B + 3, 2 * B + 1, vocab - 1]] = 8.0  # ties across blocks, the first in the second block
    x[2, vocab - 1] = 9.0  # the best in the last, partial block
    x[3] = float("-inf")  # nothing but -inf: index 0
    x[4, [7, B + 2]] = float("nan")  # NaN wins over every number: the first NaN
    x[4, 3] = float("inf")
    x[5, [2 * B + 5, B + 9]] = float("nan")  # NaNs in two blocks: the lower index, in the earlier block
    x[6, :] = 1.0  # every entry equal: index 0
    x[7, [B - 1, B]] = 7.0  # a tie straddling a block boundary
    x[8, 0] = float("inf")  # +inf first, a later +inf must not win
    x[8, vocab // 2] = float("inf")
    return x


@pytest.mark.parametrize("vocab", [3 * greedy.BLOCK + 17, 4 * greedy.BLOCK])
def test_logits_and_argmax_equal_torch(vocab):
    x = rows_with_ties(vocab).to(DEVICE)
    want_logits, want_tokens = greedy.torch_logits_and_argmax(x)
    for _ in range(2):  # a second launch finds the arrival counts zeroed again
        logits, tokens = greedy.logits_and_argmax(x)
        assert torch.equal(logits.isnan(), want_logits.isnan())
        assert torch.equal(logits.nan_to_num(0.0), want_logits.nan_to_num(0.0))
        assert tokens.dtype == torch.long and tokens.tolist() == want_tokens.tolist()
    assert want_tokens.tolist()[:4] == [5, greedy.BLOCK + 3, vocab - 1, 0]  # the rows hold what they claim


def test_a_rows_token_does_not_depend_on_the_others():
    x = rows_with_ties(3 * greedy.BLOCK + 5).to(DEVICE)
    alone = [greedy.logits_and_argmax(x[i : i + 1])[1].item() for i in range(x.shape[0])]
    assert greedy.logits_and_argmax(x)[1].tolist() == alone


def test_rows_must_be_whole():
    x = torch.zeros(4, 2 * greedy.BLOCK, device=DEVICE)
    with pytest.raises(ValueError, match="rows whole"):
        greedy.logits_and_argmax(x[:, ::2])
