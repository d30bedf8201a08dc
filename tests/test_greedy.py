"""Greedy sampling (`greedy_tokens`) gives torch.argmax's ids bit for bit: first index of the
maximum across chunk boundaries, NaN as argmax treats it, padded vocabularies, small ones."""

from __future__ import annotations

import pytest
import torch

from torchhal.core.model import greedy


def _cases(rows: int, vocab: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(rows * 1_000_003 + vocab)
    logits = torch.randn(rows, vocab, generator=generator)
    tied = logits.clone()
    peak = tied.max() + 1
    tied[:, [vocab // 2, vocab // 3, vocab - 1]] = peak  # the maximum in three chunks: the first must win
    nan = logits.clone()
    nan[:, [vocab - 1, vocab // 5]] = float("nan")
    return {"random": logits, "tied across chunks": tied, "nan": nan,
            "all -inf": torch.full((rows, vocab), float("-inf")), "many ties": logits.round(),
            "bf16 upcast": logits.bfloat16().float()}


@pytest.mark.parametrize("vocab", [128256, 151936, 50257, 32000, 1000, 7])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_greedy_tokens_are_argmax(rows: int, vocab: int) -> None:
    for name, logits in _cases(rows, vocab).items():
        assert torch.equal(greedy.greedy_tokens(logits), logits.argmax(-1)), name


def test_the_tie_case_spans_chunks_so_a_last_chunk_rule_would_fail() -> None:
    """The tie case is a real check: its maxima lie in different chunks, and taking the last
    chunk holding the maximum (a plausible slip) answers a different id."""
    vocab = 128256
    logits = _cases(1, vocab)["tied across chunks"]
    width = -(-vocab // greedy._CHUNKS)
    peaks = (logits[0] == logits.max()).nonzero().flatten()
    assert len({int(p) // width for p in peaks}) == 3
    chunk_max, chunk_index = logits.view(1, greedy._CHUNKS, width).max(-1)
    last = greedy._CHUNKS - 1 - chunk_max.flip(-1).argmax(-1, keepdim=True)
    last_chunk_rule = (last * width + chunk_index.gather(-1, last)).squeeze(-1)
    assert not torch.equal(last_chunk_rule, logits.argmax(-1))
    assert torch.equal(greedy.greedy_tokens(logits), logits.argmax(-1))


def test_a_column_slice_of_wider_logits() -> None:
    """Tensor parallel, the gathered logits are cut to the vocabulary: a strided view."""
    wide = torch.randn(2, 128256 + 64, generator=torch.Generator().manual_seed(3))
    logits = wide[:, :128256]
    assert not logits.is_contiguous()
    assert torch.equal(greedy.greedy_tokens(logits), logits.argmax(-1))
