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
`skip_special_tokens=True` (what `linattn generate` prints) leaves special tokens such as
<|endoftext|> out of the text.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch

from .checkpoint import CheckpointError
from .cli_support import finite_float, int_at_least
from .data.tokenizer import tokenizer_for_model
from .errors import LinattnError
from .models.generation import sample_next  # noqa: F401  (re-exported)
from .training.config import resolve_device


class GenerateError(LinattnError):
    """Bad generation arguments."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_sampling(temperature: float, top_k: Optional[int], top_p: Optional[float], max_new_tokens: int) -> None:
    """Raise GenerateError unless max_new_tokens is an int >= 0, temperature a finite number >= 0
    (0 = greedy), top_k None or an int >= 0 (0 = off) and top_p None or a number in (0, 1]."""
    if not _is_int(max_new_tokens) or max_new_tokens < 0:
        raise GenerateError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if not _is_real(temperature) or temperature < 0:
        raise GenerateError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (not _is_int(top_k) or top_k < 0):
        raise GenerateError(f"top_k must be an int >= 0 (0 = off), got {top_k!r}")
    if top_p is not None and (not _is_real(top_p) or not 0.0 < top_p <= 1.0):
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


def prompt_ids(tokenizer, prompt: str) -> List[int]:
    """The token ids generation starts from: the prompt's, or the end-of-document token for an empty prompt
    (a document boundary)."""
    ids = tokenizer.encode(prompt) if prompt else []
    return ids or [tokenizer.eos_id]


class TextDecoder:
    """Turns generated token ids into text pieces as they come. A byte-level BPE token can end inside a UTF-8
    character: such text is held back (up to 3 tokens) until the character is complete, so a multi-byte
    character is never shown in halves. `push(token)` returns the new text ('' while held back), `flush()`
    what is left at the end; `tokens` holds every id pushed."""

    def __init__(self, tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens: List[int] = []
        self.shown = ""
        self._held = 0

    def _text(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=self.skip_special_tokens)

    def push(self, token: int) -> str:
        self.tokens.append(token)
        text = self._text()
        if text.endswith("\ufffd") and self._held < 3:  # maybe a UTF-8 character cut between tokens
            self._held += 1
            return ""
        self._held = 0
        if text.startswith(self.shown):
            piece = text[len(self.shown):]
        else:  # decoding is not always prefix-stable at merges; show the rest from the common prefix
            k = 0
            while k < min(len(text), len(self.shown)) and text[k] == self.shown[k]:
                k += 1
            piece = text[k:]
        self.shown = text
        return piece

    def flush(self) -> str:
        text = self._text()
        if text != self.shown and text.startswith(self.shown):
            piece, self.shown = text[len(self.shown):], text
            return piece
        return ""


def stream_text(model, tokenizer, prompt: str, max_new_tokens: int, *, device=None, stats: Optional[Dict] = None,
                stop_at_eos: bool = False, skip_special_tokens: bool = False, **sampling) -> Iterator[str]:
    """Yield decoded text pieces as tokens are produced (`TextDecoder`: a UTF-8 character cut between tokens is
    held back until whole). `stats` (a dict), when given, receives tokens, seconds, tokens_per_s and
    first_token_s. `skip_special_tokens`: leave special tokens (<|endoftext|>) out of the text (they still count
    as tokens)."""
    if device is None:
        try:
            device = next(model.parameters()).device
        except StopIteration:
            device = torch.device("cpu")
    ids = prompt_ids(tokenizer, prompt)
    x = torch.tensor([ids], dtype=torch.long, device=device)
    decoder = TextDecoder(tokenizer, skip_special_tokens)
    t0 = time.perf_counter()
    first = None
    for tok in stream_tokens(model, x, max_new_tokens, eos_id=tokenizer.eos_id if stop_at_eos else None, **sampling):
        if first is None:
            first = time.perf_counter() - t0
        piece = decoder.push(tok)
        if piece:
            yield piece
        if stats is not None:
            stats["tokens"] = len(decoder.tokens)
    rest = decoder.flush()
    if rest:
        yield rest
    dt = time.perf_counter() - t0
    n = len(decoder.tokens)
    if stats is not None:
        stats.update({"tokens": n, "seconds": dt, "tokens_per_s": n / dt if dt > 0 else None,
                      "first_token_s": first, "prompt_tokens": len(ids)})


def generate_text(model, tokenizer, prompt: str, max_new_tokens: int, **kw) -> Tuple[str, Dict[str, Any]]:
    """(generated text without the prompt, stats)."""
    stats: Dict[str, Any] = {}
    text = "".join(stream_text(model, tokenizer, prompt, max_new_tokens, stats=stats, **kw))
    return text, stats


def load_generator(checkpoint: str, device: Union[str, torch.device, None] = None, tokenizer: Optional[str] = None,
                   quantize: Optional[str] = None, group_size: Optional[int] = None,
                   activations: Optional[str] = None):
    """A loaded checkpoint (model in eval mode, tokenizer) for generation, quantized when `quantize` says;
    `tokenizer`: a tokenizer.json (or a folder holding one) used instead of the checkpoint's."""
    from .quant.cli import load_for_inference

    dev = resolve_device(device if device is not None or quantize is None else "cpu")
    ck = load_for_inference(checkpoint, dev, quantize, group_size, activations)
    if tokenizer is not None:
        ck.tokenizer = tokenizer_for_model(tokenizer, int(ck.model.config.vocab_size))
    if ck.tokenizer is None:
        raise CheckpointError(f"{ck.path} has no tokenizer.json")
    ck.model.eval()
    return ck


# --------------------------------------------------------------------------- command line

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="run folder (its latest checkpoint) or a step folder")
    p.add_argument("--prompt", default="", help="text to continue (default: empty = start of a document)")
    p.add_argument("--max-new-tokens", type=int_at_least(0), default=100,
                   help="tokens to generate, >= 0 (default 100; fewer with --stop-at-eos)")
    p.add_argument("--temperature", type=finite_float(0.0), default=0.8, help="finite, >= 0; 0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int_at_least(0, "0 = off"), default=50, help="sample among the k likeliest "
                                                                                "tokens; 0 = off (default 50)")
    p.add_argument("--top-p", type=finite_float(0.0, 1.0, low_open=True), default=0.95,
                   help="nucleus mass, in (0, 1]; 1 = off (default 0.95)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--stop-at-eos", action="store_true",
                   help="stop at the end-of-document token (special tokens are never printed)")
    p.add_argument("--no-echo", action="store_true", help="do not print the prompt before the continuation")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end instead of streaming")
    p.add_argument("--device", default=None, help="auto | cpu | cuda | cuda:N | mps (default auto)")
    p.add_argument("--threads", type=int_at_least(1), default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--tokenizer", default=None, help="a tokenizer.json (or a folder holding one) to use instead of "
                                                     "the checkpoint's")
    from .quant.cli import add_quantize_arguments
    add_quantize_arguments(p)


def main(args: argparse.Namespace) -> int:
    """`linattn generate`: stream a continuation to stdout, tokens/s to stderr."""
    try:
        if args.threads:
            torch.set_num_threads(args.threads)
        check_sampling(args.temperature, args.top_k, args.top_p, args.max_new_tokens)
        ck = load_generator(args.checkpoint, args.device, getattr(args, "tokenizer", None), args.quantize,
                            args.group_size, args.activations)
        kw = dict(temperature=args.temperature, top_k=args.top_k or None,
                  top_p=args.top_p if args.top_p < 1 else None, seed=args.seed, stop_at_eos=args.stop_at_eos,
                  skip_special_tokens=True)
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
