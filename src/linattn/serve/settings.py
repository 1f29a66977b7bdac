"""The server's settings: the `linattn serve` flags, their checks, and where the API key comes from.

Light on purpose (argparse and the standard library only): `linattn --help` builds these flags without importing
the web stack.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..cli_support import finite_float, int_at_least
from ..errors import UsageError

API_KEY_ENV = "LINATTN_API_KEY"   # the environment variable read when --api-key-file is not given
PROG = "linattn serve"


@dataclass
class ServeSettings:
    """What `linattn serve` runs with (docs/serving.md lists each with its flag and default)."""

    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: Optional[str] = None
    api_key: Optional[str] = None
    chat_template: Optional[str] = None        # a file; None: the checkpoint's own template
    max_request_bytes: int = 1 << 20
    max_prompt_tokens: int = 8192
    max_tokens_limit: int = 4096
    default_max_tokens: int = 256
    max_concurrent: int = 8
    max_queue: int = 64
    prefix_cache_mb: int = 1024
    prefix_every: int = 256
    prefill_chunk: int = 256
    drain_timeout: float = 30.0
    stream_interval: float = 0.0
    threads: Optional[int] = None
    device: Optional[str] = None
    log_level: str = "info"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `linattn serve`.

    Args:
        p: The parser to add them to.
    """
    d = ServeSettings(model="")
    p.add_argument("--model", required=True, help="a linattn run folder (its latest checkpoint) or step folder; an "
                                                  "imported fla or transformers checkpoint is one")
    p.add_argument("--host", default=d.host, help="address to bind (default %(default)s: this machine only)")
    p.add_argument("--port", type=int_at_least(0, "0 = any free port"), default=d.port,
                   help="TCP port; 0 = any free port (default %(default)s)")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients pass as `model` (default: the run folder's name)")
    p.add_argument("--api-key-file", default=None,
                   help=f"a file whose first line is the API key clients must send (Authorization: Bearer KEY); "
                        f"without it the key is read from ${API_KEY_ENV}, and with neither no key is required")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template file for /v1/chat/completions (default: the checkpoint's own)")
    p.add_argument("--max-request-bytes", type=int_at_least(1), default=d.max_request_bytes,
                   help="largest request body; larger ones get 413 (default %(default)s bytes)")
    p.add_argument("--max-prompt-tokens", type=int_at_least(1), default=d.max_prompt_tokens,
                   help="longest prompt in tokens; longer ones get 400 (default %(default)s)")
    p.add_argument("--max-tokens-limit", type=int_at_least(1), default=d.max_tokens_limit,
                   help="largest max_tokens a request may ask for; more gets 400 (default %(default)s)")
    p.add_argument("--default-max-tokens", type=int_at_least(1), default=d.default_max_tokens,
                   help="max_tokens of a chat request that sets none (completions: 16, as OpenAI; default %(default)s)")
    p.add_argument("--max-concurrent", type=int_at_least(1), default=d.max_concurrent,
                   help="requests generating at once, decoded together in one batch (default %(default)s)")
    p.add_argument("--max-queue", type=int_at_least(0), default=d.max_queue,
                   help="requests waiting for a generation slot; more get 429 (default %(default)s)")
    p.add_argument("--prefix-cache-mb", type=int_at_least(0), default=d.prefix_cache_mb,
                   help="memory budget of the prefix cache of prompt states, least recently used evicted first; "
                        "0 = off (default %(default)s MiB)")
    p.add_argument("--prefix-every", type=int_at_least(1), default=d.prefix_every,
                   help="keep a prompt's state every this many tokens, besides at its end (default %(default)s)")
    p.add_argument("--prefill-chunk", type=int_at_least(1), default=d.prefill_chunk,
                   help="most prompt tokens prefilled between two decode steps (default %(default)s)")
    p.add_argument("--drain-timeout", type=float, default=d.drain_timeout,
                   help="on SIGTERM/SIGINT, seconds to let in-flight requests finish before cancelling them "
                        "(default %(default)s)")
    p.add_argument("--stream-interval", type=finite_float(0.0), default=d.stream_interval,
                   help="seconds: a stream sends text at most this often, tokens in between together (the first "
                        "at once); 0 = every token as it comes (default %(default)s)")
    p.add_argument("--threads", type=int_at_least(1), default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--device", default=None, help="auto | cpu | cuda | cuda:N | mps (default auto)")
    p.add_argument("--log-level", default=d.log_level, choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default %(default)s)")


def read_api_key(path: Optional[str], environ=os.environ) -> Optional[str]:
    """The API key: the first line of `path`, else $LINATTN_API_KEY, else None (no key required).

    Raises:
        UsageError: An unreadable or empty key file, or an empty key.
    """
    if path is not None:
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--api-key-file: cannot read {path}: {getattr(e, 'strerror', None) or e}",
                             prog=PROG) from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise UsageError(f"--api-key-file: {path} is empty (its first line is the key)", prog=PROG)
        return key
    key = environ.get(API_KEY_ENV)
    if key is None:
        return None
    if not key.strip():
        raise UsageError(f"${API_KEY_ENV} is set but empty (unset it to serve without a key)", prog=PROG)
    return key.strip()


def settings_from_args(args: argparse.Namespace) -> ServeSettings:
    """Checked settings from parsed flags (the key from its file or the environment).

    Raises:
        UsageError: A bad flag value, naming the flag.
    """
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in [0, 65535] (0: any free port), got {args.port}", prog=PROG)
    if not args.drain_timeout >= 0:
        raise UsageError(f"--drain-timeout must be >= 0 seconds, got {args.drain_timeout}", prog=PROG)
    if args.chat_template is not None and not Path(args.chat_template).is_file():
        raise UsageError(f"--chat-template: no such file: {args.chat_template}", prog=PROG)
    return ServeSettings(
        model=args.model, host=args.host, port=args.port, served_model_name=args.served_model_name,
        api_key=read_api_key(args.api_key_file), chat_template=args.chat_template,
        max_request_bytes=args.max_request_bytes, max_prompt_tokens=args.max_prompt_tokens,
        max_tokens_limit=args.max_tokens_limit, default_max_tokens=args.default_max_tokens,
        max_concurrent=args.max_concurrent, max_queue=args.max_queue, drain_timeout=args.drain_timeout,
        prefix_cache_mb=args.prefix_cache_mb, prefix_every=args.prefix_every, prefill_chunk=args.prefill_chunk,
        stream_interval=args.stream_interval,
        threads=args.threads, device=args.device, log_level=args.log_level)
