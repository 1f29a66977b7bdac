"""The `linattn` command line (also `python -m linattn`).

Each subcommand is one small function `cmd_<name>(subparsers)` that declares its arguments and sets
`run`, a function that imports the subcommand's work only when that subcommand runs. Adding a
subcommand is a few lines:

    def cmd_hello(sub):
        p = sub.add_parser("hello", help="say hello", description="...")
        p.add_argument("--name", required=True)

        def run(args):
            from .hello import main      # lazy: imported only for `linattn hello`
            return main(args)

        p.set_defaults(run=run)

    COMMANDS.append(cmd_hello)

`run(args)` returns an exit code (None means 0). Bad arguments, from argparse or from `run` raising
`UsageError`, print one line on stderr and exit with code 2. Nothing in linattn imports this module:
the pieces every command shares (`ArgParser`, `UsageError`, `report_error`) live in
`linattn.cli_support`, and `bench/` and `experiments/` declare their own arguments
(`add_arguments`, `main`), which this module and their `python -m` entry points both use.
"""
from __future__ import annotations

import sys
from typing import Callable, List, Optional, Sequence

from .cli_support import PROG, ArgParser, UsageError, report_error

# ----------------------------------------------------------------------------------------------
# Subcommands
# ----------------------------------------------------------------------------------------------

def cmd_bench(sub) -> None:
    from . import bench  # the registry only: no benchmark module is imported

    p = sub.add_parser("bench", help=bench.HELP, description=bench.description())
    bench.add_arguments(p)
    p.set_defaults(run=bench.main)


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


# train / eval / generate: their arguments and logic live in linattn.training.cli and linattn.generate.
def cmd_train(sub) -> None:
    from .training.cli import DESCRIPTION, add_arguments
    p = sub.add_parser("train", help="train a language model on a text file/folder (default: the stdlib)",
                       description=DESCRIPTION)
    add_arguments(p)

    def run(args):
        from .training.cli import main
        return main(args)

    p.set_defaults(run=run)


def cmd_eval(sub) -> None:
    from .training.cli import add_eval_arguments
    p = sub.add_parser("eval", help="loss and perplexity of a checkpoint on a text file/folder")
    add_eval_arguments(p)

    def run(args):
        from .training.cli import eval_main
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
    from . import experiments  # the registry only: no experiment module is imported

    p = sub.add_parser("experiment", help=experiments.HELP, description=experiments.description())
    experiments.add_arguments(p)
    p.set_defaults(run=experiments.main)


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
        add(sub)
    return parser


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
        return report_error(_one_line(e), e.prog or PROG)
    except KeyboardInterrupt:
        sys.stderr.write(f"{PROG}: interrupted\n")
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
