"""Benchmarks, run as `linattn bench NAME [options]` (or `python -m linattn.bench NAME`).

The registry below maps a name to (module, one-line description). A benchmark module defines

    DESCRIPTION: str                      shown by `linattn bench NAME --help`
    add_arguments(parser) -> None         its options (parser is an argparse parser)
    run(args) -> int                      runs it; raise linattn.errors.UsageError for bad arguments

and uses `linattn.bench.common` for timing, memory, the machine description and its outputs
(table on stdout, JSON and PNG under results/bench/NAME/). Adding a benchmark is one module and one
line here; modules are imported only when their benchmark runs.

This package imports only `linattn.cli_support` (never `linattn.cli`): the `linattn bench` command
and `python -m linattn.bench` are both built from `add_arguments` and `main` below.
"""
from __future__ import annotations

import argparse
import importlib
from typing import Dict, Optional, Sequence, Tuple

from .. import cli_support
from ..cli_support import ArgParser, UsageError

PROG = "linattn bench"

BENCHMARKS: Dict[str, Tuple[str, str]] = {
    "ops": ("linattn.bench.ops", "operator speed vs T: linear attention, the delta rule, softmax attention"),
    "tlinformer": ("linattn.bench.tlinformer", "TLinFormer cache-miss/hit latency and cache bytes vs context N "
                                               "(paper Fig. 9), vs softmax+KV cache and a linear LM"),
    "decode": ("linattn.bench.decode",
               "per-token decode latency and cache bytes vs context, each mixer vs softmax+KV cache"),
    "infer": ("linattn.bench.infer", "CPU inference of one model shape: prompt / decode tok/s and decode over the "
                                     "memory floor, linattn vs transformers (+ kernelize), fp32 / bf16, llama.cpp"),
    "vision": ("linattn.bench.vision", "YOLO-LAT necks: parameters, FLOPs, CPU latency per image at 320/640, "
                                       "neck cost vs grid size"),
    "gpu": ("linattn.bench.gpu", "the prepared GPU check: kernels vs PyTorch, compute-sanitizer, timings vs SDPA "
                                 "and fla, LM steps, within a time budget (--dry-run: CPU)"),
    "data": ("linattn.bench.data", "data preparation: peak memory and time of reading, tokenizer training, tokenizing"),
    "hf": ("linattn.bench.hf", "transformers' linear-attention models: their PyTorch fallbacks vs linattn.hf.kernelize "
                               "(prefill, decode, training step, peak memory)"),
    "threads": ("linattn.bench.threads", "thread scaling of the compiled CPU kernels at one long sequence, quiet "
                                         "or with a busy core (--busy-core)"),
    "train": ("linattn.bench.train", "LM training throughput (fwd + bwd + AdamW tokens/s) per mixer vs softmax"),
    "serve": ("linattn.bench.serve", "linattn serve vs linattn generate: decode tokens/s, /health latency under load"),
    "quant": ("linattn.bench.quant", "fp32 / bf16 / int8 / int4 weights on the CPU: prompt and decode tokens/s, decode "
                                     "time over the memory floor, perplexity and greedy agreement of a checkpoint"),
}

HELP = "run a benchmark (" + ", ".join(BENCHMARKS) + ")"


def description() -> str:
    listing = "\n".join(f"  {name:<12} {desc}" for name, (_, desc) in BENCHMARKS.items())
    return ("Run a benchmark. Available benchmarks:\n" + listing +
            "\n\n`linattn bench NAME --help` shows a benchmark's own options.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `linattn bench`: the benchmark's name, then its own arguments.

    Args:
        p: The parser to add them to.
    """
    p.add_argument("name", metavar="NAME", nargs="?", help="which benchmark: " + ", ".join(BENCHMARKS))
    p.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own arguments")


def main(args: argparse.Namespace) -> int:
    """Run the benchmark named in `args` (parsed by a parser set up with `add_arguments`).

    Args:
        args: The parsed `linattn bench` arguments (name, and the benchmark's own arguments).

    Returns:
        The benchmark's exit code.

    Raises:
        UsageError: No benchmark named, an unknown one, or bad arguments for it.
    """
    if args.name is None:
        raise UsageError("which benchmark? choose from: " + ", ".join(BENCHMARKS), prog=PROG)
    return run_benchmark(args.name, args.args)


def load(name: str):
    """Import and return the module of benchmark `name`.

    Args:
        name: A key of `BENCHMARKS` ("ops", "decode", "train", "hf", "gpu", ...).

    Returns:
        The module, with its `DESCRIPTION`, `add_arguments(parser)` and `run(args)`.

    Raises:
        UsageError: An unknown benchmark.

    Examples:
        >>> from linattn.bench import load
        >>> module = load("ops")
        >>> callable(module.add_arguments) and callable(module.run)
        True
    """
    if name not in BENCHMARKS:
        raise UsageError(f"unknown benchmark {name!r}; choose from: {', '.join(BENCHMARKS)}", prog=PROG)
    return importlib.import_module(BENCHMARKS[name][0])


def run_benchmark(name: str, argv: Optional[Sequence[str]] = None) -> int:
    """Parse `argv` with benchmark `name`'s options and run it: what `linattn bench NAME ARGS...` does.

    The benchmark prints its table and writes its JSON (and PNG) under results/bench/NAME/ unless told otherwise
    (`linattn bench NAME --help` lists its options).

    Args:
        name: A key of `BENCHMARKS`.
        argv: The benchmark's own arguments (None: none).

    Returns:
        The exit code (0: success).

    Raises:
        UsageError: An unknown benchmark or bad arguments.
    """
    module = load(name)
    parser = ArgParser(prog=f"{PROG} {name}", description=getattr(module, "DESCRIPTION", None))
    module.add_arguments(parser)
    args = parser.parse_args(list(argv or []))
    rc = module.run(args)
    return 0 if rc is None else int(rc)


def command_line(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m linattn.bench NAME ...`: like `linattn bench NAME ...`.

    A `UsageError` is reported as one line on stderr (exit code 2).

    Args:
        argv: The arguments after the program name (None: none).

    Returns:
        The exit code.
    """
    return cli_support.command_line(PROG, description(), add_arguments, main, argv)


__all__ = ["BENCHMARKS", "PROG", "HELP", "description", "add_arguments", "main", "load", "run_benchmark",
           "command_line"]
