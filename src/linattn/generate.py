"""Text generation from a checkpoint, streaming tokens as they are produced (`linattn generate`).

    from linattn.generate import load_generator, stream_tokens, generate_text
    ck = load_generator("runs/efla")                       # a linattn.checkpoint.Checkpoint
    for piece in stream_text(ck.model, ck.tokenizer, "def main(", max_new_tokens=100):
        print(piece, end="", flush=True)
    text, stats = generate_text(ck.model, ck.tokenizer, "import ", max_new_tokens=50, seed=0)
    stats["tokens_per_s"]

The model is any registered model family's (`linattn.models.family.CausalLM`): it decodes through
its own `stream()`, the prompt once (prefill), then one token per step from its cache, so a new
token costs O(1) in the sequence length for linear mixers (TLinFormer: its cache hit/miss modes).

Sampling: temperature 0 is greedy; otherwise logits / temperature, then top-k, then top-p
(nucleus) filtering, then a draw from a `torch.Generator` seeded with `seed` (reproducible).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch

from .checkpoint import CheckpointError, load_checkpoint
from .errors import LinattnError
from .models.generation import sample_next  # noqa: F401  (re-exported)
from .training.config import resolve_device


class GenerateError(LinattnError):
    """Bad generation arguments."""


def check_sampling(temperature: float, top_k: Optional[int], top_p: Optional[float], max_new_tokens: int) -> None:
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise GenerateError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if temperature is None or temperature < 0:
        raise GenerateError(f"temperature must be >= 0, got {temperature!r}")
    if top_k is not None and top_k < 0:
        raise GenerateError(f"top_k must be >= 0 (0 = off), got {top_k!r}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise GenerateError(f"top_p must be in (0, 1], got {top_p!r}")


@torch.no_grad()
def stream_tokens(model, input_ids: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
                  top_k: Optional[int] = None, top_p: Optional[float] = None, seed: Optional[int] = None,
                  eos_id: Optional[int] = None) -> Iterator[int]:
    """Yield new token ids one at a time (batch 1) from the model's own `stream()` (`CausalLM`).
    Stops after `max_new_tokens` or at `eos_id`."""
    check_sampling(temperature, top_k, top_p, max_new_tokens)
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.shape[0] != 1 or input_ids.shape[1] < 1:
        raise GenerateError(f"input_ids must be [1, T] with T >= 1, got {tuple(input_ids.shape)}")
    stream = getattr(model, "stream", None)
    if stream is None:
        raise GenerateError(f"{type(model).__name__} is not a causal LM of a registered model family "
                            f"(it has no stream())")
    for tok in stream(input_ids[0], max_new_tokens, temperature=temperature, top_k=top_k or None, top_p=top_p,
                      seed=seed, eos_token_id=eos_id):
        yield int(tok)


def stream_text(model, tokenizer, prompt: str, max_new_tokens: int, *, device=None, stats: Optional[Dict] = None,
                stop_at_eos: bool = False, **sampling) -> Iterator[str]:
    """Yield decoded text pieces as tokens are produced. A byte-level BPE token can end inside a
    UTF-8 character: such text is held back (up to 3 tokens) until the character is complete. `stats` (a dict),
    when given, receives tokens, seconds, tokens_per_s and first_token_s."""
    if device is None:
        try:
            device = next(model.parameters()).device
        except StopIteration:
            device = torch.device("cpu")
    ids = tokenizer.encode(prompt) if prompt else []
    if not ids:
        ids = [tokenizer.eos_id]   # an empty prompt starts at a document boundary
    x = torch.tensor([ids], dtype=torch.long, device=device)
    new: List[int] = []
    shown = ""
    t0 = time.perf_counter()
    first = None
    held = 0
    for tok in stream_tokens(model, x, max_new_tokens, eos_id=tokenizer.eos_id if stop_at_eos else None, **sampling):
        if first is None:
            first = time.perf_counter() - t0
        new.append(tok)
        text = tokenizer.decode(new)
        if text.endswith("\ufffd") and held < 3:  # maybe a UTF-8 character cut between tokens
            held += 1
            continue
        held = 0
        if text.startswith(shown):
            piece = text[len(shown):]
        else:  # decoding is not always prefix-stable at merges; show the rest from the common prefix
            k = 0
            while k < min(len(text), len(shown)) and text[k] == shown[k]:
                k += 1
            piece = text[k:]
        shown = text
        if piece:
            yield piece
        if stats is not None:
            stats["tokens"] = len(new)
    text = tokenizer.decode(new)
    if text != shown and text.startswith(shown) and text[len(shown):]:
        yield text[len(shown):]
    dt = time.perf_counter() - t0
    if stats is not None:
        stats.update({"tokens": len(new), "seconds": dt, "tokens_per_s": len(new) / dt if dt > 0 else None,
                      "first_token_s": first, "prompt_tokens": len(ids)})


def generate_text(model, tokenizer, prompt: str, max_new_tokens: int, **kw) -> Tuple[str, Dict[str, Any]]:
    """(generated text without the prompt, stats)."""
    stats: Dict[str, Any] = {}
    text = "".join(stream_text(model, tokenizer, prompt, max_new_tokens, stats=stats, **kw))
    return text, stats


def load_generator(checkpoint: str, device: Union[str, torch.device, None] = None):
    """A loaded checkpoint (model in eval mode, tokenizer) for generation."""
    dev = resolve_device(device)
    ck = load_checkpoint(checkpoint, device=dev)
    if ck.tokenizer is None:
        raise CheckpointError(f"{ck.path} has no tokenizer.json")
    ck.model.eval()
    return ck


# --------------------------------------------------------------------------- command line

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="run folder (its latest checkpoint) or a step folder")
    p.add_argument("--prompt", default="", help="text to continue (default: empty = start of a document)")
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=50, help="0 = off (default 50)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus mass, 1 = off (default 0.95)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--stop-at-eos", action="store_true", help="stop at the end-of-document token")
    p.add_argument("--no-echo", action="store_true", help="do not print the prompt before the continuation")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end instead of streaming")
    p.add_argument("--device", default=None, help="auto | cpu | cuda")
    p.add_argument("--threads", type=int, default=None)


def main(args: argparse.Namespace) -> int:
    """`linattn generate`: stream a continuation to stdout, tokens/s to stderr."""
    try:
        if args.threads:
            torch.set_num_threads(args.threads)
        check_sampling(args.temperature, args.top_k, args.top_p, args.max_new_tokens)
        ck = load_generator(args.checkpoint, args.device)
        kw = dict(temperature=args.temperature, top_k=args.top_k or None,
                  top_p=args.top_p if args.top_p < 1 else None, seed=args.seed, stop_at_eos=args.stop_at_eos)
        stats: Dict[str, Any] = {}
        if args.json:
            text = "".join(stream_text(ck.model, ck.tokenizer, args.prompt, args.max_new_tokens, stats=stats, **kw))
            print(json.dumps({"prompt": args.prompt, "text": text, "checkpoint": str(ck.path), "step": ck.step,
                              **stats}))
            return 0
        out = sys.stdout
        if not args.no_echo:
            out.write(args.prompt)
            out.flush()
        for piece in stream_text(ck.model, ck.tokenizer, args.prompt, args.max_new_tokens, stats=stats, **kw):
            out.write(piece)
            out.flush()
        out.write("\n")
        out.flush()
        tps = stats.get("tokens_per_s")
        print(f"[linattn] {stats.get('tokens', 0)} tokens in {stats.get('seconds', 0.0):.2f} s"
              + (f" = {tps:.1f} tokens/s" if tps else "")
              + (f" (first token after {stats['first_token_s'] * 1000:.0f} ms)" if stats.get("first_token_s") else ""),
              file=sys.stderr)
        return 0
    except LinattnError as e:
        print(f"linattn: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
