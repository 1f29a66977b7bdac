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


# serve: an OpenAI-compatible HTTP server (linattn.serve, needs the `serve` extra).
def cmd_serve(sub) -> None:
    from .serve.settings import add_arguments  # light: the web stack is imported when the server runs
    p = sub.add_parser("serve", help="serve a checkpoint over HTTP with the OpenAI API (completions, chat)",
                       description="An OpenAI-compatible server for a checkpoint (docs/serving.md; needs "
                                   "`pip install linattn[serve]`). Binds 127.0.0.1 unless --host says otherwise.")
    add_arguments(p)

    def run(args):
        from .serve.server import main
        return main(args)

    p.set_defaults(run=run)


def cmd_quantize(sub) -> None:
    from .quant.cli import add_command_arguments
    p = sub.add_parser("quantize", help="write a checkpoint's model with int8 / int4 weights (for generate, eval)")
    add_command_arguments(p)

    def run(args):
        from .errors import LinattnError
        from .quant.cli import command_main

        try:
            return command_main(args)
        except LinattnError as e:
            return report_error(_one_line(e), f"{PROG} quantize")

    p.set_defaults(run=run)


COMMANDS += [cmd_serve, cmd_quantize]


# export-hf / import-hf: Hugging Face transformers folders (linattn.hf, needs the `hf` extra).
def _hf_command(sub, name: str, help: str, source_flag: str, source_help: str, out_help: str, entry: str):
    p = sub.add_parser(name, help=help, description=help + " (needs `pip install linattn[hf]`)")
    p.add_argument(source_flag, required=True, help=source_help)
    p.add_argument("--out", required=True, help=out_help)
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")

    def run(args):
        import importlib.util

        if importlib.util.find_spec("transformers") is None:
            raise UsageError(f"{name} needs the transformers library: pip install 'linattn[hf]'", prog=f"{PROG} {name}")
        from .errors import LinattnError
        from .hf import convert  # lazy: transformers is imported only for these commands

        try:
            return getattr(convert, entry)(args)
        except LinattnError as e:
            return report_error(_one_line(e), f"{PROG} {name}")

    p.set_defaults(run=run)
    return p


def cmd_export_hf(sub) -> None:
    _hf_command(sub, "export-hf", "write a checkpoint and its tokenizer as a Hugging Face transformers folder",
                "--checkpoint", "run folder (its latest checkpoint) or step folder",
                "the transformers folder to write (AutoModelForCausalLM / AutoTokenizer / pipeline load it)",
                "export_main")


def cmd_import_hf(sub) -> None:
    _hf_command(sub, "import-hf", "write a Hugging Face folder exported by linattn, or a flash-linear-attention "
                "model folder, as a linattn checkpoint",
                "--model", "the transformers folder (export-hf's --out, a saved LinattnForCausalLM, or a saved "
                "flash-linear-attention model: transformer, gla, gated_deltanet, ...)",
                "run folder to write the checkpoint into (for eval, generate)", "import_main"
                ).add_argument("--tokenizer", help="the tokenizer to keep: a folder, tokenizer.json or SentencePiece "
                               "tokenizer.model (default: the model folder's own)")


COMMANDS += [cmd_export_hf, cmd_import_hf]


# experiment: the experiment suite (linattn.experiments); each experiment parses its own options.
def cmd_experiment(sub) -> None:
    from . import experiments  # the registry only: no experiment module is imported

    p = sub.add_parser("experiment", help=experiments.HELP, description=experiments.description())
    experiments.add_arguments(p)
    p.set_defaults(run=experiments.main)


COMMANDS.append(cmd_experiment)


# vision: YOLO-LAT object detection (linattn.vision); each action parses its own options.
def cmd_vision(sub) -> None:
    p = sub.add_parser(
        "vision", help="YOLO-LAT object detection: train, eval, detect, export-onnx, synth",
        description="YOLO-LAT object detection (linear attention in the neck of a small YOLO):\n"
                    "  linattn vision train --data DIR|synthetic --out DIR --epochs N\n"
                    "                       --neck hadamard_exp|softmax|conv|<feature map>\n"
                    "  linattn vision eval --checkpoint DIR [--data DIR]\n"
                    "  linattn vision detect --checkpoint DIR IMAGE...\n"
                    "  linattn vision export-onnx --checkpoint DIR --out FILE\n"
                    "  linattn vision synth --out DIR [--mnist DIR|glyphs]\n\n"
                    "`linattn vision ACTION --help` shows an action's own options.")
    p.add_argument("action", metavar="ACTION", nargs="?", help="train, eval, detect, export-onnx or synth")
    p.add_argument("args", nargs="...", help="the action's options")

    def run(args):
        from .vision.commands import main  # lazy: imported only for `linattn vision`
        return main(args.action, args.args)

    p.set_defaults(run=run)


COMMANDS.append(cmd_vision)


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
