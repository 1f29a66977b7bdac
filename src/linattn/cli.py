"""The `linattn` command line (also `python -m linattn`).

Each subcommand is one small function `cmd_<name>(subparsers)` that declares its arguments and sets
`run`, a function that imports the subcommand's module only when that subcommand runs (so one
broken or slow module never affects the others). Adding a subcommand is a few lines:

    def cmd_train(sub):
        p = sub.add_parser("train", help="train a model", description="...")
        p.add_argument("--config", required=True)

        def run(args):
            from .train import main      # lazy: imported only for `linattn train`
            return main(args)

        p.set_defaults(run=run)

    COMMANDS.append(cmd_train)   # (or add it to the COMMANDS list below)

`run(args)` returns an exit code (None means 0). Bad arguments, from argparse or from `run` raising
`UsageError`, print one line on stderr and exit with code 2.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, List, Optional, Sequence

from .cli_support import PROG, ArgParser, UsageError  # noqa: F401  (re-exported)


# ----------------------------------------------------------------------------------------------
# Subcommands
# ----------------------------------------------------------------------------------------------

def cmd_bench(sub) -> None:
    from .bench import BENCHMARKS  # the registry only: no benchmark module is imported

    listing = "\n".join(f"  {name:<12} {desc}" for name, (_, desc) in BENCHMARKS.items())
    p = sub.add_parser(
        "bench", help="run a benchmark (" + ", ".join(BENCHMARKS) + ")",
        description="Run a benchmark. Available benchmarks:\n" + listing +
                    "\n\n`linattn bench NAME --help` shows a benchmark's own options.")
    p.add_argument("name", metavar="NAME", nargs="?", help="which benchmark: " + ", ".join(BENCHMARKS))
    p.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own arguments")

    def run(args):
        if args.name is None:
            raise UsageError("which benchmark? choose from: " + ", ".join(BENCHMARKS), prog="linattn bench")
        from .bench import run_benchmark
        return run_benchmark(args.name, args.args)

    p.set_defaults(run=run)


def cmd_demo(sub) -> None:
    from .demo import __doc__ as demo_doc, add_arguments  # light: the demo's work is imported when it runs

    p = sub.add_parser(
        "demo", help="exactness, scaling, a short training and generation (about 5 minutes on a CPU)",
        description=demo_doc)
    add_arguments(p)

    def run(args):
        from .demo import main
        return main(args)

    p.set_defaults(run=run)


COMMANDS: List[Callable] = [cmd_bench, cmd_demo]


# train / eval / generate: their arguments and logic live in linattn.train and linattn.generate.
def cmd_train(sub) -> None:
    from .train import DESCRIPTION, add_arguments
    p = sub.add_parser("train", help="train a language model on a text file/folder (default: the stdlib)",
                       description=DESCRIPTION)
    add_arguments(p)

    def run(args):
        from .train import main
        return main(args)

    p.set_defaults(run=run)


def cmd_eval(sub) -> None:
    from .train import add_eval_arguments
    p = sub.add_parser("eval", help="loss and perplexity of a checkpoint on a text file/folder")
    add_eval_arguments(p)

    def run(args):
        from .train import eval_main
        return eval_main(args)

    p.set_defaults(run=run)


def cmd_generate(sub) -> None:
    from .generate import add_arguments
    p = sub.add_parser("generate", help="stream text from a checkpoint (reports tokens/s)")
    add_arguments(p)

    def run(args):
        from .generate import main
        return main(args)

    p.set_defaults(run=run)


COMMANDS += [cmd_train, cmd_eval, cmd_generate]


# experiment: the experiment suite (linattn.experiments); each experiment parses its own options.
def cmd_experiment(sub) -> None:
    from .experiments import EXPERIMENTS  # the registry only: no experiment module is imported

    listing = "\n".join(f"  {name:<18} {desc}" for name, (_, desc) in EXPERIMENTS.items())
    p = sub.add_parser(
        "experiment", help="run an experiment (" + ", ".join(EXPERIMENTS) + "), writing results/NAME/",
        description="Run an experiment: linattn experiment NAME --budget quick|full [--data DIR] [--out DIR] "
                    "[--seed N] [--resume | --overwrite]. Available experiments:\n" + listing +
                    "\n\n`linattn experiment NAME --help` shows an experiment's own options.")
    p.add_argument("name", metavar="NAME", help="which experiment: " + ", ".join(EXPERIMENTS))
    p.add_argument("args", nargs=argparse.REMAINDER, help="the experiment's options")

    def run(args):
        from .experiments import run_experiment
        return run_experiment(args.name, args.args)

    p.set_defaults(run=run)


COMMANDS.append(cmd_experiment)


# ----------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------

def build_parser() -> ArgParser:
    from . import __version__

    parser = ArgParser(prog=PROG, description="linattn: exact linear attention for PyTorch.")
    parser.add_argument("--version", action="version", version=f"linattn {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=ArgParser)
    for add in COMMANDS:
        try:
            add(sub)
        except Exception as e:  # one broken module must not take the other commands down with it
            _broken_command(sub, add, e)
    return parser


def _broken_command(sub, add, exc: Exception) -> None:
    """Register a command whose declaration failed: it reports why when used."""
    name = add.__name__[4:] if add.__name__.startswith("cmd_") else add.__name__
    if name in sub.choices:
        return
    why = f"{type(exc).__name__}: {_one_line(exc)}"
    p = sub.add_parser(name, help=f"(unavailable: {why})", add_help=False)
    p.add_argument("args", nargs=argparse.REMAINDER)

    def run(args):
        sys.stderr.write(f"{PROG} {name}: unavailable: {why}\n")
        return 1

    p.set_defaults(run=run)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.command is None:
            choices = ", ".join(sorted(parser._subparsers._group_actions[0].choices))
            raise UsageError(f"a command is required ({choices}); see `linattn --help`", prog=PROG)
        rc = args.run(args)
        return 0 if rc is None else int(rc)
    except UsageError as e:
        sys.stderr.write(f"{e.prog or PROG}: error: {_one_line(e)}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write(f"{PROG}: interrupted\n")
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
