"""Benchmarks, run as `linattn bench NAME [options]` (or `python -m linattn.bench NAME`).

The registry below maps a name to (module, one-line description). A benchmark module defines

    DESCRIPTION: str                      shown by `linattn bench NAME --help`
    add_arguments(parser) -> None         its options (parser is an argparse parser)
    run(args) -> int                      runs it; raise linattn.cli.UsageError for bad arguments

and uses `linattn.bench.common` for timing, memory, the machine description and its outputs
(table on stdout, JSON and PNG under results/bench/NAME/). Adding a benchmark is one module and one
line here; modules are imported only when their benchmark runs.
"""
from __future__ import annotations

import importlib
from typing import Dict, Optional, Sequence, Tuple

BENCHMARKS: Dict[str, Tuple[str, str]] = {
    "ops": ("linattn.bench.ops", "operator speed vs T: linear attention, the delta rule, softmax attention"),
    "tlinformer": ("linattn.bench.tlinformer", "TLinFormer cache-miss/hit latency and cache bytes vs context N "
                                               "(paper Fig. 9), vs softmax+KV cache and a linear LM"),
    "decode": ("linattn.bench.decode", "per-token decode latency and cache bytes vs context, each mixer vs softmax+KV cache"),
}


def load(name: str):
    """Import and return the module of benchmark `name`."""
    from ..cli import UsageError

    if name not in BENCHMARKS:
        raise UsageError(f"unknown benchmark {name!r}; choose from: {', '.join(BENCHMARKS)}", prog="linattn bench")
    return importlib.import_module(BENCHMARKS[name][0])


def run_benchmark(name: str, argv: Optional[Sequence[str]] = None) -> int:
    """Parse `argv` with benchmark `name`'s options and run it; returns the exit code."""
    from ..cli import ArgParser

    module = load(name)
    parser = ArgParser(prog=f"linattn bench {name}", description=getattr(module, "DESCRIPTION", None))
    module.add_arguments(parser)
    args = parser.parse_args(list(argv or []))
    rc = module.run(args)
    return 0 if rc is None else int(rc)


__all__ = ["BENCHMARKS", "load", "run_benchmark"]
