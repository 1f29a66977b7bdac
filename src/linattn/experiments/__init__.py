"""Experiments, run as `linattn experiment NAME --budget BUDGET [--data DIR] [--out DIR]
[--seed N] [--resume | --overwrite | --report-only]`; each writes `results/NAME/` (JSON, a markdown
table, plots). Budgets are per experiment (quick, full; mad and smnist-robustness also standard).

    mad                 the six MAD synthetic tasks for softmax, linear attention, the delta-rule
                        family and the rest (compare: EFLA paper, Table 2); --budget standard is
                        calibrated by the softmax sanity gate; --seeds N
    smnist-robustness   the EFLA paper's sequential-MNIST robustness sweeps, DeltaNet vs EFLA and
                        EFLA's beta variants (--methods), --replicates N
    lm                  language-model comparison at equal parameters and tokens (--seeds N)
    ela-ablations       ELA-GPT: Hyper-Link vs pre-norm, the MoE routing bias (eq. 14/15), the
                        causal memory lobe; 1,000 steps, 2 seeds (ELA paper, sections V-VI)
    efla-variants       EFLA's adaptive-decay and loose-beta variants vs EFLA and DeltaNet
                        (EFLA paper, Table 1)
    tlinformer          TLinFormer vs a Transformer of equal parameter count (TLinFormer paper,
                        Table 1, lengths / 4)

A module defines DESCRIPTION, add_arguments(parser) (its own options; the common ones are added
by `linattn.experiments.common.add_common_arguments`) and run(args) -> exit code. Modules are
imported only when their experiment runs. This package imports only `linattn.cli_support` (never
`linattn.cli`): `linattn experiment` and `python -m linattn.experiments` are both built from
`add_arguments` and `main` below.
"""
from __future__ import annotations

import argparse
import importlib
from typing import Dict, Optional, Sequence, Tuple

from .. import cli_support
from ..cli_support import ArgParser, UsageError

PROG = "linattn experiment"

EXPERIMENTS: Dict[str, Tuple[str, str]] = {
    "mad": ("linattn.experiments.mad", "the six MAD synthetic tasks: softmax, linear, DeltaNet, Gated DeltaNet, EFLA"),
    "smnist-robustness": ("linattn.experiments.smnist",
                          "sequential MNIST, DeltaNet vs EFLA under input scaling, noise and pixel dropout"),
    "lm": ("linattn.experiments.lm", "language models at equal parameters and tokens: perplexity and tokens/s"),
    "ela-ablations": ("linattn.experiments.ela_ablations",
                      "ELA-GPT: Hyper-Link vs pre-norm, MoE bias eq. 14/15, causal memory lobe (1,000 steps)"),
    "efla-variants": ("linattn.experiments.efla_variants",
                      "EFLA + adaptive decay, EFLA + loose beta, EFLA, DeltaNet (EFLA paper, Table 1)"),
    "tlinformer": ("linattn.experiments.tlinformer",
                   "TLinFormer vs a standard Transformer of equal parameter count (TLinFormer paper, Table 1)"),
}

HELP = "run an experiment (" + ", ".join(EXPERIMENTS) + "), writing results/NAME/"


def description() -> str:
    listing = "\n".join(f"  {name:<18} {desc}" for name, (_, desc) in EXPERIMENTS.items())
    return ("Run an experiment: linattn experiment NAME --budget quick|full [--data DIR] [--out DIR] "
            "[--seed N] [--resume | --overwrite]. Available experiments:\n" + listing +
            "\n\n`linattn experiment NAME --help` shows an experiment's own options.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `linattn experiment`: the experiment's name, then its own options."""
    p.add_argument("name", metavar="NAME", help="which experiment: " + ", ".join(EXPERIMENTS))
    p.add_argument("args", nargs=argparse.REMAINDER, help="the experiment's options")


def main(args: argparse.Namespace) -> int:
    """Run the experiment named in `args` (parsed by a parser set up with `add_arguments`)."""
    return run_experiment(args.name, args.args)


def load(name: str):
    if name not in EXPERIMENTS:
        raise UsageError(f"unknown experiment {name!r}; choose from: {', '.join(EXPERIMENTS)}", prog=PROG)
    return importlib.import_module(EXPERIMENTS[name][0])


def build_parser(name: str):
    module = load(name)
    parser = ArgParser(prog=f"{PROG} {name}", description=getattr(module, "DESCRIPTION", None))
    module.add_arguments(parser)
    return module, parser


def run_experiment(name: str, argv: Optional[Sequence[str]] = None) -> int:
    """Parse `argv` with experiment `name`'s options and run it; returns the exit code.

    Bad requests (an occupied results folder, missing data, a mismatched resume: `ExperimentError`)
    raise `UsageError` (one line on stderr, exit code 2)."""
    from .common import ExperimentError  # imported here: the registry stays light for `linattn --help`

    module, parser = build_parser(name)
    args = parser.parse_args(list(argv or []))
    try:
        rc = module.run(args)
    except ExperimentError as e:
        raise UsageError(str(e), prog=f"{PROG} {name}") from None
    return 0 if rc is None else int(rc)


def command_line(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m linattn.experiments NAME ...`: like `linattn experiment NAME ...`; returns the exit code."""
    return cli_support.command_line(PROG, description(), add_arguments, main, argv)


__all__ = ["EXPERIMENTS", "PROG", "HELP", "description", "add_arguments", "main", "load", "build_parser",
           "run_experiment", "command_line"]
