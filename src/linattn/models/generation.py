"""Sampling helpers for `LanguageModel.generate` / `LanguageModel.stream`."""
from __future__ import annotations

from typing import Optional, Union

import torch


def make_generator(generator: Union[torch.Generator, int, None], device) -> Optional[torch.Generator]:
    """A torch.Generator from a Generator, an int seed, or None (the global RNG)."""
    if generator is None or isinstance(generator, torch.Generator):
        return generator
    if isinstance(generator, int) and not isinstance(generator, bool):
        g = torch.Generator(device=torch.device(device))
        g.manual_seed(generator)
        return g
    raise TypeError(f"generator must be a torch.Generator, an int seed or None, got {type(generator).__name__}")


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: Optional[int] = None,
                top_p: Optional[float] = None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Next token ids `[B]` from logits `[B, V]`.

    temperature 0 is greedy (argmax); top_k keeps the k most likely tokens; top_p keeps the
    smallest set whose probability reaches p (nucleus); both apply after the temperature.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must lie in (0, 1], got {top_p!r}")
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop = (probs.cumsum(-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
