"""Sampling helpers for the models' `generate` / `stream` (any `CausalLM`)."""
from __future__ import annotations

from typing import Callable, Iterator, List, Optional, Sequence, Union

import torch

from ..errors import LinattnError, LinattnTypeError


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of a model's parameters (CPU for a model without any)."""
    p = next(iter(model.parameters()), None)
    return p.device if p is not None else torch.device("cpu")


def make_generator(generator: Union[torch.Generator, int, None], device) -> Optional[torch.Generator]:
    """A torch.Generator from a Generator, an int seed, or None (the global RNG)."""
    if generator is None or isinstance(generator, torch.Generator):
        return generator
    if isinstance(generator, int) and not isinstance(generator, bool):
        g = torch.Generator(device=torch.device(device))
        g.manual_seed(generator)
        return g
    raise LinattnTypeError(f"generator must be a torch.Generator, an int seed or None, got {type(generator).__name__}")


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: Optional[int] = None,
                top_p: Optional[float] = None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Next token ids from logits.

    temperature 0 is greedy (argmax); top_k keeps the k most likely tokens; top_p keeps the
    smallest set whose probability reaches p (nucleus); both apply after the temperature.

    Args:
        logits: `[B, V]`.
        temperature: >= 0; 0 is greedy.
        top_k: Keep the k most likely tokens (None: all).
        top_p: Keep the smallest set whose probability reaches p (None: all).
        generator: For reproducible sampling (None: torch's global generator).

    Returns:
        Token ids `[B]`.

    Raises:
        LinattnError: A negative temperature, or a bad top_k / top_p.
    """
    if temperature < 0:
        raise LinattnError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise LinattnError(f"top_k must be a positive int or None, got {top_k!r}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise LinattnError(f"top_p must lie in (0, 1], got {top_p!r}")
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


def stream_tokens(model: torch.nn.Module, input_ids: Union[torch.Tensor, Sequence[int]], max_new_tokens: int,
                  forward: Callable, temperature: float = 1.0, top_k: Optional[int] = None,
                  top_p: Optional[float] = None, generator: Union[torch.Generator, int, None] = None,
                  seed: Optional[int] = None, eos_token_id: Optional[int] = None) -> Iterator:
    """The sampling loop shared by the language models' `stream`.

    `forward(new_ids, prev_out)` returns an output with `.logits`: it is called with the whole
    prompt and None first, then with each sampled token `[B, 1]` and the previous output (whose
    `.cache` it may continue). Yields an int per step for a 1-D prompt, a `[B]` tensor for a
    `[B, T]` one; stops after max_new_tokens, or once every sequence has yielded eos_token_id.
    """
    ids, single = _prompt(model, input_ids, max_new_tokens)
    gen = make_generator(seed if generator is None else generator, ids.device)
    was_training = model.training
    model.eval()
    try:
        done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
        with torch.no_grad():
            out = forward(ids, None)
        for _ in range(max_new_tokens):
            with torch.no_grad():
                tok = sample_next(out.logits[:, -1], temperature, top_k, top_p, gen)
            if eos_token_id is not None:
                tok = torch.where(done, torch.full_like(tok, eos_token_id), tok)
                done = done | (tok == eos_token_id)
            yield int(tok[0]) if single else tok
            if eos_token_id is not None and bool(done.all()):
                break
            with torch.no_grad():
                out = forward(tok[:, None], out)
    finally:
        model.train(was_training)


def _prompt(model: torch.nn.Module, input_ids, max_new_tokens) -> tuple:
    """(ids `[B, T]`, whether the prompt was 1-D), the prompt and max_new_tokens checked."""
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=model_device(model))
    single = ids.dim() == 1
    if single:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise LinattnError(f"input_ids must be a non-empty [T] or [B, T] sequence of ids, got shape {tuple(ids.shape)}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise LinattnError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
    return ids, single


def greedy_tokens(model: torch.nn.Module, input_ids: Union[torch.Tensor, Sequence[int]], max_new_tokens: int,
                  forward: Callable, decode_rest: Callable, top_k: Optional[int] = None,
                  top_p: Optional[float] = None, generator: Union[torch.Generator, int, None] = None,
                  seed: Optional[int] = None, eos_token_id: Optional[int] = None) -> List:
    """`stream_tokens` at temperature 0, collected: the same tokens (and the same checks of the arguments), the
    first from the prompt's logits, the rest from `decode_rest(tok [B, 1], out, n, eos_token_id)`: the next up to n
    tokens `[B, k]` as the stream would yield them (a finished row's eos, stopping once every row is finished), in
    one go, or None (then one `forward` per token, as the stream)."""
    ids, single = _prompt(model, input_ids, max_new_tokens)
    make_generator(seed if generator is None else generator, ids.device)   # (checked as the stream checks it)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = forward(ids, None)
        tokens: List[torch.Tensor] = []
        done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
        rest = None
        for i in range(max_new_tokens):
            with torch.no_grad():
                tok = sample_next(out.logits[:, -1], 0.0, top_k, top_p)
            if eos_token_id is not None:
                tok = torch.where(done, torch.full_like(tok, eos_token_id), tok)
                done = done | (tok == eos_token_id)
            tokens.append(tok)
            if i + 1 == max_new_tokens or (eos_token_id is not None and bool(done.all())):
                break
            if i == 0:
                with torch.no_grad():
                    rest = decode_rest(tok[:, None], out, max_new_tokens - 1, eos_token_id)
                if rest is not None:
                    tokens += list(rest.unbind(1))
                    break
            with torch.no_grad():
                out = forward(tok[:, None], out)
    finally:
        model.train(was_training)
    return [int(t[0]) for t in tokens] if single else tokens


def join_generated(model: torch.nn.Module, input_ids, tokens: List) -> torch.Tensor:
    """Prompt followed by the tokens `stream_tokens` yielded: `[T + n]` or `[B, T + n]`."""
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=model_device(model))
    if not tokens:
        return ids
    if ids.dim() == 1:
        return torch.cat([ids, torch.tensor(tokens, dtype=torch.long, device=ids.device)])
    return torch.cat([ids, torch.stack(tokens, dim=1)], dim=1)
