"""The `linattn train` and `linattn eval` command lines.

Every field of `TrainConfig` and of every registered model family's config (`LMConfig`,
`TLinFormerConfig`, ...) is a `--field-name` flag, generated from the dataclasses with their help
text (`linattn.cli_support.add_dataclass_arguments`). A field shared by several configs has one
flag (e.g. `--d-model`); `--vocab-size` sizes the tokenizer, and the model always takes the
tokenizer's vocabulary. `--model NAME` (alias `--arch`) picks the model family (default: the
preset's, the --model-config file's, or "lm").
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from .. import checkpoint as ckpt
from ..cli_support import add_dataclass_arguments, flag_name, given_values, int_at_least, report_error
from ..data.corpus import PackedTokens, load_corpus, split_documents, tokenize_documents
from ..data.sources import missing_data_error
from ..data.tokenizer import tokenizer_for_model
from ..errors import CheckpointError, LinattnError, UsageError
from ..logs import get_logger
from ..models.family import ModelFamily, config_from_dict, config_to_dict, families, family_of, get_family
from .config import (
    DTYPE_ALIASES,
    TRAJECTORY_FIELDS,
    TrainConfig,
    TrainError,
    check_resume_compatible,
    legacy_values,
    resolve_device,
)
from .loop import TrainResult, step_line, train
from .trainer import evaluate

log = get_logger("training")

DESCRIPTION = """\
Train a language model. Reads --data (a text file, or every UTF-8 text file under a folder; with
no --data the Python standard library's .py sources, capped at 8 MiB), trains a byte-level BPE
tokenizer on the training split (or loads --tokenizer), packs the documents into --seq-len
windows, and trains with AdamW, warmup + cosine decay and gradient clipping. Writes
OUT/metrics.jsonl and atomic checkpoints OUT/step_N/ (safetensors weights, config.json,
tokenizer.json, optimizer/RNG state). SIGINT/SIGTERM finish the step, save and exit (code 128+N);
--resume continues exactly where the run stopped. Every field of the training config and of the
model family's config is a flag (below); on --resume the checkpoint's values are the defaults.

example: linattn train --data corpus/ --out runs/efla --mixer efla --d-model 256 --n-layers 4 \\
             --n-heads 4 --seq-len 256 --batch-size 8 --steps 2000
"""

DEFAULT_OUT = os.path.join("runs", "train")
TRAIN_FIELDS = tuple(f.name for f in dataclasses.fields(TrainConfig))


def model_field_names() -> List[str]:
    """Fields of the registered model families' configs (union, in order), without "arch"."""
    names: List[str] = []
    for name in families():
        for f in dataclasses.fields(get_family(name).config_cls):
            if f.name != "arch" and f.name not in names:
                names.append(f.name)
    return names


# --------------------------------------------------------------------------- linattn train

def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `linattn train`: one per config field (given only when set on the command line)."""
    g = p.add_argument_group("data, optimization and run (TrainConfig)")
    seen = set(add_dataclass_arguments(g, TrainConfig))
    g.add_argument("--no-progress", dest="progress", action="store_const", const=False, default=argparse.SUPPRESS,
                   help="no progress bar (same as --progress false); a line per logged step is printed instead")
    g.add_argument("--quiet", action="store_true",
                   help="no progress bar and no log lines on stderr (warnings, errors and the final JSON summary "
                        "still print)")
    g.add_argument("--resume", action="store_true", help="continue --out's latest checkpoint (fresh if none); "
                                                         "not with --overwrite")
    g.add_argument("--overwrite", action="store_true", help="start over in an --out that holds a previous run "
                                                            "(deletes it); not with --resume")
    g = p.add_argument_group("model")
    g.add_argument("--model", "--arch", dest="arch", choices=families(), default=argparse.SUPPRESS,
                   help="model family: " + "; ".join(f"{n}: {get_family(n).description}" for n in families())
                   + " (default: the preset's or lm)")
    g.add_argument("--preset", default=None, help="a model preset from linattn.models.PRESETS (flags override it)")
    g.add_argument("--model-config", default=None, help="JSON file with a model config dict (flags override it)")
    seen.add("arch")
    for name in families():
        fam = get_family(name)
        group = p.add_argument_group(f"model family {name} ({fam.config_cls.__name__}; shared fields listed once)")
        seen.update(add_dataclass_arguments(group, fam.config_cls, skip=seen))


def main(args: argparse.Namespace) -> int:
    """`linattn train`: returns the exit code (0 done, 2 bad input, 128+N stopped by signal N)."""
    try:
        return _train_main(args)
    except LinattnError as e:
        return report_error(flag_message(e))


_CONFIG_FIELD = re.compile(r"\b[A-Z][A-Za-z]*Config\.([a-z][a-z0-9_]*)")


def flag_message(error: Exception) -> str:
    """The error on one line, with the config fields it names (`TrainConfig.min_lr_ratio`,
    `LMConfig.d_model`) written as the flags that set them (`--min-lr-ratio`, `--d-model`)."""
    return _CONFIG_FIELD.sub(lambda m: flag_name(m.group(1)), " ".join(str(error).split()))


def _train_main(args: argparse.Namespace) -> int:
    if args.resume and getattr(args, "init_from", None) is not None:
        raise UsageError("--init-from and --resume exclude each other: --resume continues the run in --out, "
                         "--init-from starts a new run there from another checkpoint's weights")
    if args.resume and args.overwrite:
        raise UsageError("--resume and --overwrite exclude each other: --resume continues the run in --out, "
                         "--overwrite deletes it and starts over")
    out = Path(getattr(args, "out", None) or DEFAULT_OUT)
    saved_train, saved_model, done = _saved_run(out) if args.resume else ({}, None, None)
    cfg = train_config_from_args(args, saved_train, out)
    if getattr(args, "quiet", False):
        cfg.progress = False
    cfg.validate()
    if done is not None and cfg.steps < done:
        raise TrainError(f"--steps {cfg.steps} is below the {done} steps the run in {out} has already done; "
                         f"pass --steps {done} or more to resume it")
    for note in cfg.advice():
        log.warning(f"[linattn] warning: {flag_message(note)}")
    if saved_model is not None:
        model_config = resumed_model_config(args, cfg, saved_model)
    elif cfg.init_from is not None:
        if cfg.data is not None and not Path(cfg.data).exists():
            raise missing_data_error(args.data)
        model_config = init_model_config(args, cfg)
    else:
        if cfg.data is not None and not Path(cfg.data).exists():
            raise missing_data_error(args.data)
        model_config = model_config_from_args(args, cfg)
    step_lines = cfg.progress is False and not getattr(args, "quiet", False)
    res = train(cfg, model_config, resume=args.resume, overwrite=args.overwrite,
                on_log=_step_line_printer(cfg.steps) if step_lines else None)
    return _report(res)


def _step_line_printer(steps: int):
    """on_log for --no-progress: the training loop shows no bar, so print one line per metrics record
    (what the loop itself prints when stderr is not a terminal)."""
    def show(rec: Dict[str, Any]) -> None:
        log.info(step_line(rec, steps))
    return show


def _saved_run(out: Path) -> Tuple[Dict[str, Any], Optional[Dict[str, Any]], Optional[int]]:
    """(train config dict, model config dict, steps done) of the run folder's latest checkpoint, if any."""
    ck = ckpt.find_latest_checkpoint(out) if out.is_dir() else None
    if ck is None:
        log.info(f"[linattn] no checkpoint in {out}; starting a new run")
        return {}, None, None
    meta = ckpt.read_checkpoint_config(ck)
    step = meta.get("step")
    return (dict(meta.get("train") or {}), meta.get("model"),
            step if isinstance(step, int) and not isinstance(step, bool) else None)


def train_config_from_args(args: argparse.Namespace, saved: Optional[Dict[str, Any]] = None,
                           out: Optional[Path] = None) -> TrainConfig:
    """TrainConfig from the defaults, then a resumed run's saved values, then the flags given."""
    saved = legacy_values(saved or {})
    vals = TrainConfig().to_dict()
    vals.update({k: v for k, v in saved.items() if k in vals and k != "progress"})
    if saved and "doc_boundaries" not in saved:
        vals["doc_boundaries"] = False   # a run from before document boundaries: keep its trajectory
    given = given_values(args, TRAIN_FIELDS)
    if "dtype" in given:
        given["dtype"] = DTYPE_ALIASES.get(given["dtype"], given["dtype"])
    for k, v in given.items():
        if k in TRAJECTORY_FIELDS and k in saved and saved[k] != v:
            raise TrainError(f"config/checkpoint mismatch: {flag_name(k)} {v!r} but the checkpoint was "
                             f"trained with {saved[k]!r}")
        vals[k] = v
    vals["out"] = str(out if out is not None else given.get("out") or DEFAULT_OUT)
    for k in ("data", "tokenizer", "init_from"):  # absolute, so that `eval` with no --data finds them from anywhere
        if given.get(k) is not None:
            vals[k] = os.path.abspath(given[k])
    vals["progress"] = given.get("progress")
    return TrainConfig.from_dict(vals)


def _explicit_model_flags(args: argparse.Namespace, fam: ModelFamily) -> Dict[str, Any]:
    """The model flags given, checked to be fields of the family's config."""
    fields = {f.name for f in dataclasses.fields(fam.config_cls)}
    given = given_values(args, model_field_names())
    for k in given:
        if k not in fields and k not in TRAIN_FIELDS:
            raise TrainError(f"{flag_name(k)} is not a setting of model family {fam.name!r} "
                             f"({fam.config_cls.__name__}); pick the family with --model")
    return {k: v for k, v in given.items() if k in fields}


def _base_model_dict(args: argparse.Namespace) -> Dict[str, Any]:
    """The model config dict of --preset, updated by the --model-config file."""
    d: Dict[str, Any] = {}
    if getattr(args, "preset", None):
        from ..models import PRESETS

        if args.preset not in PRESETS:
            raise TrainError(f"unknown preset {args.preset!r}; available: {', '.join(sorted(PRESETS))}")
        preset = PRESETS[args.preset]
        d.update(config_to_dict(preset() if callable(preset) else preset))
    if getattr(args, "model_config", None):
        path = Path(args.model_config)
        if not path.is_file():
            raise TrainError(f"--model-config {path}: " + ("is not a file" if path.exists() else "no such file")
                             + "; expected a JSON file holding a model config object")
        try:
            loaded = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise TrainError(f"cannot read --model-config {path}: {e}") from None
        if not isinstance(loaded, dict):
            raise TrainError(f"--model-config {path} must hold a JSON object (a model config such as "
                             f'{{"d_model": 256, "mixer": "efla"}}), got a JSON {type(loaded).__name__}')
        d.update(loaded)
    return d


def model_config_from_args(args: argparse.Namespace, cfg: TrainConfig):
    """The model config of a new run: --preset, then --model-config, then the flags (flags win)."""
    d = _base_model_dict(args)
    if "arch" in vars(args):
        d["arch"] = args.arch
    fam = family_of(d)
    d.update(_explicit_model_flags(args, fam))
    d.setdefault("vocab_size", cfg.vocab_size)
    if d.get("max_seq_len") is None or d["max_seq_len"] < cfg.seq_len:
        d["max_seq_len"] = cfg.seq_len
    try:
        model_config = config_from_dict(d)
    except (TypeError, ValueError) as e:
        raise TrainError(" ".join(str(e).split())) from None
    if "vocab_size" not in vars(args) and (args.preset or args.model_config):
        cfg.vocab_size = int(model_config.vocab_size)  # the preset's vocabulary, for the tokenizer
    return model_config


def init_model_config(args: argparse.Namespace, cfg: TrainConfig):
    """The model config of an --init-from run: the checkpoint's, with the model flags given checked against it
    (`init_from.model_config_with_flags`); --preset, --model-config and another --vocab-size are refused."""
    from .init_from import checkpoint_model_config, model_config_with_flags

    for flag in ("preset", "model_config"):
        if getattr(args, flag, None):
            raise TrainError(f"{flag_name(flag)} cannot be combined with --init-from, which takes the model config "
                             f"from the checkpoint")
    ck, base = checkpoint_model_config(cfg.init_from)
    if "vocab_size" in vars(args) and args.vocab_size != getattr(base, "vocab_size", args.vocab_size):
        raise TrainError(f"--vocab-size {args.vocab_size} contradicts the checkpoint's vocab_size = {base.vocab_size} "
                         f"({ck}); --init-from uses the checkpoint's tokenizer (leave the flag out)")
    given = {k: v for k, v in given_values(args, model_field_names()).items() if k != "vocab_size"}
    return model_config_with_flags(cfg.init_from, given, getattr(args, "arch", None))


def resumed_model_config(args: argparse.Namespace, cfg: TrainConfig, saved_model: Dict[str, Any]):
    """The checkpoint's model config; model flags given on a resume must agree with it."""
    explicit = _explicit_model_flags(args, family_of(saved_model))
    if "arch" in vars(args):
        explicit["arch"] = args.arch
    check_resume_compatible(cfg, {}, explicit, saved_model)
    return ckpt.model_config_from_dict(saved_model)


def _report(res: TrainResult) -> int:
    if _rank() != 0:   # several processes: rank 0 reports
        return 128 + int(res.signal) if res.interrupted and res.signal else 0
    if res.interrupted:
        log.info(f"[linattn] stopped at step {res.step}; checkpoint {res.checkpoint}; continue with --resume")
        return 128 + int(res.signal) if res.signal else 0
    print(json.dumps({"step": res.step, "loss": res.losses[-1][1] if res.losses else None,
                      "val_loss": res.val_loss, "val_ppl": res.val_ppl, "tokens_per_s": res.tokens_per_s,
                      "checkpoint": str(res.checkpoint) if res.checkpoint else None,
                      "n_params": res.model.num_parameters(), "skipped_steps": len(res.skipped_steps)}))
    return 0


def _rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


# --------------------------------------------------------------------------- linattn eval

def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="run folder (its latest checkpoint) or a step folder")
    p.add_argument("--data", default=None, help="text file or folder, evaluated whole (default: the validation "
                                                "split of the checkpoint's training data)")
    p.add_argument("--seq-len", type=int_at_least(1), default=None,
                   help="window length, >= 1 (default: the training seq_len)")
    p.add_argument("--batch-size", type=int_at_least(1), default=8, help="windows per batch, >= 1 (default 8)")
    p.add_argument("--max-batches", type=int_at_least(1), default=None,
                   help="evaluate at most this many batches (default: all)")
    p.add_argument("--max-data-bytes", type=int_at_least(1), default=None,
                   help="read at most this many bytes of --data (default: all of it; the run's own cap for its "
                        "validation split)")
    p.add_argument("--device", default=None, help="auto | cpu | cuda | cuda:N | mps (default auto)")
    p.add_argument("--threads", type=int_at_least(1), default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--tokenizer", default=None, help="a tokenizer.json (or a folder holding one) to use instead of "
                                                     "the checkpoint's")
    from ..quant.cli import add_quantize_arguments
    add_quantize_arguments(p)


def eval_main(args: argparse.Namespace) -> int:
    """`linattn eval`: perplexity of a checkpoint on --data (or its own validation split)."""
    try:
        if args.threads:
            torch.set_num_threads(args.threads)
        from ..quant.cli import load_for_inference

        device = resolve_device(args.device if args.device is not None or args.quantize is None else "cpu")
        if args.data is not None and not Path(args.data).exists():
            raise missing_data_error(args.data)
        ck = load_for_inference(args.checkpoint, device, args.quantize, args.group_size, args.activations)
        if getattr(args, "tokenizer", None) is not None:
            ck.tokenizer = tokenizer_for_model(args.tokenizer, int(ck.model.config.vocab_size))
        if ck.tokenizer is None:
            raise CheckpointError(f"{ck.path} has no tokenizer.json")
        seq_len = args.seq_len if args.seq_len is not None else int(ck.train_config.get("seq_len") or 256)
        tokens, source = _eval_tokens(args, ck, seq_len)
        eos = (ck.tokenizer.eos_id if ck.train_config.get("doc_boundaries") and
               getattr(ck.model, "supports_cu_seqlens", False) else None)   # as the run was trained
        res = evaluate(ck.model, PackedTokens(tokens, seq_len, name=str(source)), batch_size=args.batch_size,
                       max_batches=args.max_batches, device=device,
                       dtype=str(ck.train_config.get("dtype") or "float32"), eos_id=eos)
    except LinattnError as e:
        return report_error(" ".join(str(e).split()))
    if args.json:
        print(json.dumps({"checkpoint": str(ck.path), "step": ck.step, "data": str(source), **res.to_dict()}))
    else:
        print(f"loss {res.loss:.4f}  perplexity {res.ppl:.3f}  tokens {res.tokens}  "
              f"({ck.path}, step {ck.step}, {source})")
    return 0


def _eval_tokens(args: argparse.Namespace, ck: ckpt.Checkpoint, seq_len: int):
    """(tokens, description): all of --data, or the validation split of the run's own data."""
    if args.data is not None:
        docs = load_corpus(args.data, max_bytes=args.max_data_bytes)
        return tokenize_documents(docs, ck.tokenizer), args.data
    cfg = TrainConfig.from_dict({**ck.train_config, "seq_len": seq_len, "tokenizer": None})
    docs = load_corpus(cfg.data, max_bytes=cfg.max_data_bytes)
    _, val_docs = split_documents(docs, cfg.val_fraction if cfg.val_fraction > 0 else 0.05)
    return tokenize_documents(val_docs, ck.tokenizer), f"{cfg.data or 'stdlib'} (validation split)"


__all__ = ["DESCRIPTION", "add_arguments", "main", "add_eval_arguments", "eval_main", "train_config_from_args",
           "model_config_from_args", "resumed_model_config", "init_model_config", "model_field_names", "flag_message"]
