"""`linattn serve`: load a checkpoint, build the app, run it under uvicorn until SIGTERM/SIGINT.

On SIGTERM (or SIGINT) the server stops accepting connections, lets in-flight requests finish (at most
--drain-timeout seconds, then cancels them), stops the engine and exits 0. Once listening it prints one line on
stderr, `[linattn] serving NAME at http://HOST:PORT`, with the real port (--port 0 picks a free one).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import ipaddress
import signal
import sys
import threading
import time
from pathlib import Path

from ..cli_support import report_error
from ..errors import LinattnError, UsageError
from ..logs import get_logger
from .settings import PROG, ServeSettings, settings_from_args

log = get_logger("serve")
NEEDS = ("starlette", "uvicorn", "jinja2")   # the `serve` extra


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or localhost) reaches this machine only."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def build_state(settings: ServeSettings):
    """The loaded checkpoint wrapped as the app's `ServerState` (model, tokenizer, engine, chat renderer)."""
    import torch

    from ..generate import load_generator
    from .app import ServerState
    from .chat import load_renderer
    from .engine import Engine
    from .metrics import Metrics

    if settings.threads:
        torch.set_num_threads(settings.threads)
    ck = load_generator(settings.model, settings.device)
    tok = ck.tokenizer
    eos_text = tok.decode([tok.eos_id])
    render = load_renderer(Path(ck.path), settings.chat_template, eos_text)
    metrics = Metrics()
    given = Path(settings.model).resolve()   # a run folder, or one of its step folders: the run's name either way
    name = settings.served_model_name or (given.parent.name if given == Path(ck.path).resolve() else given.name)
    engine = Engine(ck.model, tok, settings.max_concurrent, settings.max_queue, metrics,
                    prefix_cache_bytes=settings.prefix_cache_mb << 20, prefix_every=settings.prefix_every,
                    prefill_chunk=settings.prefill_chunk)
    return ServerState(engine=engine,
                       tokenizer=tok, vocab_size=tok.vocab_size, settings=settings, model_name=name,
                       render_chat=render, metrics=metrics, created=int(time.time()))


def _server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's server, except that a SIGTERM/SIGINT ends `serve()` normally (exit code 0) instead of
        re-raising the signal after the drain, and the listening address is announced on stderr."""

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, h in previous.items():
                    signal.signal(s, h)

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                host, port = self.servers[0].sockets[0].getsockname()[:2]
                print(f"[linattn] serving {self.config.app.state.model_name} at http://{host}:{port}",
                      file=sys.stderr, flush=True)

    return DrainingServer


def serve(settings: ServeSettings) -> int:
    """Run the server until a signal ends it; the exit code."""
    import uvicorn

    from .app import build_app

    state = build_state(settings)
    app = build_app(state)
    app.state.model_name = state.model_name
    if not is_loopback(settings.host) and settings.api_key is None:
        log.warning("serving on %s without an API key: anyone who can reach this address can use the model "
                    "(set --api-key-file or $LINATTN_API_KEY)", settings.host)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            timeout_graceful_shutdown=settings.drain_timeout, lifespan="on", access_log=False)
    server = _server_class()(config)
    server.run()
    return 0 if server.started else 1


def main(args: argparse.Namespace) -> int:
    """`linattn serve` (flags: `linattn.serve.settings.add_arguments`)."""
    missing = [m for m in NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        raise UsageError(f"serving needs {', '.join(missing)}: pip install 'linattn[serve]'", prog=PROG)
    settings = settings_from_args(args)
    try:
        return serve(settings)
    except UsageError:
        raise
    except LinattnError as e:
        return report_error(" ".join(str(e).split()), PROG)
