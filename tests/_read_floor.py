"""The read floor's reader off a GPU: what `musebench.stock.read_floor.triton_read` computes
(program p sums chunks p, p + programs, ... of the int32 words, with int32 wrap), in torch, so that
the families' baselines build and check their `read floor` paths on CPU."""

from __future__ import annotations

import torch


def emulated_triton_read(words: torch.Tensor, partials: torch.Tensor, config, reads: list | None = None) -> None:
    """`triton_read(words, partials, config)` in torch; `reads`, where given, logs `words`."""
    if reads is not None:
        reads.append(words)
    chunk, programs = config.chunk_words, partials.numel()
    chunks = -(-words.numel() // chunk)
    padded = torch.zeros(chunks * chunk, dtype=torch.int64, device=words.device)
    padded[: words.numel()] = words
    sums = torch.zeros(programs, dtype=torch.int64, device=words.device)
    sums.index_add_(0, torch.arange(chunks, device=words.device) % programs, padded.view(chunks, chunk).sum(1))
    partials.copy_(((sums + 2 ** 31) % 2 ** 32 - 2 ** 31).to(torch.int32))
