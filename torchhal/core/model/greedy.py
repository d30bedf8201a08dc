"""Greedy sampling: the id of each row's largest logit."""

from __future__ import annotations

import torch

from torchhal.values import ceil_div

# Chunks per row for the first pass; 256 keeps a 128k vocabulary's chunks at ~500 logits.
_CHUNKS = 256


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(-1)` for [B, V] logits, in the same bits: the first index of each row's
    maximum (of its first NaN, if any). torch's reduction gives each row one block of threads,
    which at a 128k vocabulary and a few rows leaves most of a GPU idle (27 us a step on an
    H200 at batch 1); the maximum of each chunk first, then of the chunks' maxima, spreads the
    row over the device. Ties stay first-index: the first chunk holding the maximum wins, and
    within it the first index."""
    assert logits.dim() == 2, f"Model.logits gives [rows, vocab], not {tuple(logits.shape)}"
    rows, vocab = logits.shape
    width = ceil_div(vocab, _CHUNKS)
    if vocab <= 2 * width:  # a small vocabulary: one pass is already wide enough
        return logits.argmax(-1)
    pad = width * _CHUNKS - vocab
    if pad:  # -inf never beats a real logit; an all -inf row still answers index 0, as argmax does
        logits = torch.nn.functional.pad(logits, (0, pad), value=float("-inf"))
    chunk_max, chunk_index = logits.reshape(rows, _CHUNKS, width).max(-1)
    best_chunk = chunk_max.argmax(-1, keepdim=True)
    return (best_chunk * width + chunk_index.gather(-1, best_chunk)).squeeze(-1)
