"""Experiments, run as `linattn experiment NAME --budget quick|full [--data DIR] [--out DIR]
[--seed N] [--resume | --overwrite]`; each writes `results/NAME/` (JSON, a markdown table, plots).

    mad                 the six MAD synthetic tasks for softmax, linear attention, DeltaNet,
                        Gated DeltaNet and EFLA (compare: EFLA paper, Table 2)
    smnist-robustness   the EFLA paper's sequential-MNIST robustness sweeps, DeltaNet vs EFLA
    lm                  language-model comparison at equal parameters and tokens

A module defines DESCRIPTION, add_arguments(parser) (its own options; the common ones are added
by `linattn.experiments.common.add_common_arguments`) and run(args) -> exit code. Modules are
imported only when their experiment runs.
"""
from __future__ import annotations

import importlib
from typing import Dict, Optional, Sequence, Tuple

EXPERIMENTS: Dict[str, Tuple[str, str]] = {
    "mad": ("linattn.experiments.mad", "the six MAD synthetic tasks: softmax, linear, DeltaNet, Gated DeltaNet, EFLA"),
    "smnist-robustness": ("linattn.experiments.smnist",
                          "sequential MNIST, DeltaNet vs EFLA under input scaling, noise and pixel dropout"),
    "lm": ("linattn.experiments.lm", "language models at equal parameters and tokens: perplexity and tokens/s"),
}


def load(name: str):
    from ..cli import UsageError

    if name not in EXPERIMENTS:
        raise UsageError(f"unknown experiment {name!r}; choose from: {', '.join(EXPERIMENTS)}",
                         prog="linattn experiment")
    return importlib.import_module(EXPERIMENTS[name][0])


def build_parser(name: str):
    from ..cli import ArgParser

    module = load(name)
    parser = ArgParser(prog=f"linattn experiment {name}", description=getattr(module, "DESCRIPTION", None))
    module.add_arguments(parser)
    return module, parser


def run_experiment(name: str, argv: Optional[Sequence[str]] = None) -> int:
    """Parse `argv` with experiment `name`'s options and run it; returns the exit code.

    Bad requests (an occupied results folder, missing data, a mismatched resume) raise
    `linattn.cli.UsageError` (one line on stderr, exit code 2)."""
    from ..cli import UsageError
    from .common import ExperimentError

    module, parser = build_parser(name)
    args = parser.parse_args(list(argv or []))
    try:
        rc = module.run(args)
    except ExperimentError as e:
        raise UsageError(str(e), prog=f"linattn experiment {name}") from None
    return 0 if rc is None else int(rc)


__all__ = ["EXPERIMENTS", "load", "build_parser", "run_experiment"]
