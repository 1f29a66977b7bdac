"""`TrainConfig`: everything about a training run except the model (that is the model family's
config), with one documented field per setting; the `linattn train` flags are generated from it.

The "train" schema of a checkpoint. It lives at the top level, not in `linattn.training`, so that
`linattn.checkpoint` (which the trainer imports) validates a checkpoint's train section with a plain
module-level import; `linattn.training.config` re-exports it.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from .devices import resolve_device  # noqa: F401  (re-exported: training's device names)
from .errors import ConfigError, LinattnError
from .models.family import config_from_dict, config_to_dict

DTYPES = ("float32", "bfloat16")
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16"}
PARALLEL = ("ddp", "fsdp")


class TrainError(LinattnError):
    """A bad request to train/eval (bad config, occupied output folder, mismatched resume)."""


class TrainingDiverged(TrainError, FloatingPointError):
    """The training loss became inf or NaN."""


class TrainConfigError(TrainError, ConfigError):
    """A `TrainConfig` field with a bad value; `field` names it (the message starts `TrainConfig.<field>`)."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"TrainConfig.{field_name} {message}")
        self.field = field_name


def _f(default: Any, help: str, **meta: Any) -> Any:
    return field(default=default, metadata={"help": help, **meta})


@dataclass
class TrainConfig:
    """Everything about a run except the model architecture (that is the model config).

    Every field is also a `linattn train` flag (`--seq-len`, ...) with the help below. `validate()` checks the
    values (a bad one raises `TrainConfigError` naming the field; `train` calls it). `train` saves the config with
    every checkpoint, and a resume refuses a change of the fields that decide the trajectory (`TRAJECTORY_FIELDS`).

    Attributes:
        data: Text file or folder of UTF-8 text files; none: the Python standard library's .py sources (8 MiB).
        out: Run folder for checkpoints and metrics.jsonl (none in Python: nothing written).
        tokenizer: tokenizer.json, or a folder or run holding one; none: train a byte-level BPE on the training split.
        init_from: Start a new run (step 0, fresh optimizer and schedule) from this run's latest checkpoint or this step
            folder: its weights, tokenizer and model config (model flags that contradict it are refused); not with
            --resume.
        vocab_size: Vocabulary of a trained tokenizer (an upper bound); the model's vocab_size is always the
            tokenizer's.
        max_data_bytes: Cap on the text read, >= 1 (none: all of a path, 8 MiB of the stdlib).
        val_fraction: Share of the documents held out for validation, in [0, 1) (0: no validation).
        seq_len: Tokens per training window.
        batch_size: Windows per optimizer step: the global batch, split across processes (torchrun) and --grad-accum
            micro-batches, so the math does not depend on either.
        grad_accum: Micro-batches per optimizer step in each process (gradients accumulated).
        doc_boundaries: Keep packed documents apart: every mixer's state restarts at each <|endoftext|> (cu_seqlens);
            false: windows run across documents.
        steps: Optimizer steps of the whole run (>= 1; on a resume, at least the steps done).
        lr: Peak learning rate (finite, > 0).
        min_lr_ratio: Final learning rate / peak, in [0, 1], reached by the cosine decay at the last step.
        warmup: Linear warmup steps (>= 0; more than --steps: the peak is never reached).
        weight_decay: AdamW decoupled weight decay, >= 0 (matrices and embeddings only).
        beta1: AdamW beta1, in [0, 1).
        beta2: AdamW beta2, in [0, 1).
        eps: AdamW epsilon, > 0.
        grad_clip: Max gradient norm, >= 0; 0: no clipping.
        seed: Seed of the initialisation and of the batch order.
        log_every: Steps per metrics record.
        save_every: Steps per checkpoint; <= 0: only at the end (and on a signal).
        eval_every: Steps per validation; <= 0: only at the end.
        eval_batches: Validation batches per evaluation.
        keep_last: Step folders kept in the run folder, >= 1; none: keep every one.
        device: Auto | cpu | cuda | cuda:N | mps.
        threads: Torch CPU threads, >= 1 (none: torch's default).
        dtype: Autocast dtype (bf16 = bfloat16); weights and optimizer state stay float32.
        parallel: Several processes (torchrun): ddp replicates the model, fsdp shards it (FSDP2, fully_shard per block);
            ignored in one process.
        activation_checkpointing: Recompute each block in the backward pass (less memory, more time).
        compile: Torch.compile the model.
        progress: Progress bar; none: only on a terminal (else one line per record).
        skip_nonfinite: Skip (and count) a batch whose loss or gradient is inf or NaN instead of stopping the run; the
            weights are never updated from it.

    Examples:
        >>> from linattn.training import TrainConfig
        >>> cfg = TrainConfig(data="corpus/", out="runs/efla", seq_len=256, batch_size=8, steps=2000)
        >>> TrainConfig.from_dict(cfg.to_dict()) == cfg
        True
    """
    data: Optional[str] = _f(None, "text file or folder of UTF-8 text files; none: the Python standard "
                                   "library's .py sources (8 MiB)")
    out: Optional[str] = _f(None, "run folder for checkpoints and metrics.jsonl (none in Python: nothing written)",
                            shown_default="runs/train")
    tokenizer: Optional[str] = _f(None, "tokenizer.json, or a folder or run holding one; none: train a "
                                        "byte-level BPE on the training split")
    init_from: Optional[str] = _f(None, "start a new run (step 0, fresh optimizer and schedule) from this run's "
                                        "latest checkpoint or this step folder: its weights, tokenizer and model "
                                        "config (model flags that contradict it are refused); not with --resume")
    vocab_size: int = _f(4096, "vocabulary of a trained tokenizer (an upper bound); the model's vocab_size "
                               "is always the tokenizer's")
    max_data_bytes: Optional[int] = _f(None, "cap on the text read, >= 1 (none: all of a path, 8 MiB of the stdlib)")
    val_fraction: float = _f(0.05, "share of the documents held out for validation, in [0, 1) (0: no validation)")
    seq_len: int = _f(256, "tokens per training window")
    batch_size: int = _f(8, "windows per optimizer step: the global batch, split across processes (torchrun) "
                            "and --grad-accum micro-batches, so the math does not depend on either")
    grad_accum: int = _f(1, "micro-batches per optimizer step in each process (gradients accumulated)")
    doc_boundaries: bool = _f(True, "keep packed documents apart: every mixer's state restarts at each "
                                    "<|endoftext|> (cu_seqlens); false: windows run across documents")
    steps: int = _f(1000, "optimizer steps of the whole run (>= 1; on a resume, at least the steps done)")
    lr: float = _f(1e-3, "peak learning rate (finite, > 0)")
    min_lr_ratio: float = _f(0.1, "final learning rate / peak, in [0, 1], reached by the cosine decay at the last step")
    warmup: int = _f(100, "linear warmup steps (>= 0; more than --steps: the peak is never reached)")
    weight_decay: float = _f(0.1, "AdamW decoupled weight decay, >= 0 (matrices and embeddings only)")
    beta1: float = _f(0.9, "AdamW beta1, in [0, 1)")
    beta2: float = _f(0.95, "AdamW beta2, in [0, 1)")
    eps: float = _f(1e-8, "AdamW epsilon, > 0")
    grad_clip: float = _f(1.0, "max gradient norm, >= 0; 0: no clipping")
    seed: int = _f(0, "seed of the initialisation and of the batch order")
    log_every: int = _f(10, "steps per metrics record")
    save_every: int = _f(500, "steps per checkpoint; <= 0: only at the end (and on a signal)")
    eval_every: int = _f(500, "steps per validation; <= 0: only at the end")
    eval_batches: int = _f(20, "validation batches per evaluation")
    keep_last: Optional[int] = _f(2, "step folders kept in the run folder, >= 1; none: keep every one")
    device: str = _f("auto", "auto | cpu | cuda | cuda:N | mps")
    threads: Optional[int] = _f(None, "torch CPU threads, >= 1 (none: torch's default)")
    dtype: str = _f("float32", "autocast dtype (bf16 = bfloat16); weights and optimizer state stay float32",
                    choices=DTYPES + tuple(DTYPE_ALIASES))
    parallel: str = _f("ddp", "several processes (torchrun): ddp replicates the model, fsdp shards it (FSDP2, "
                              "fully_shard per block); ignored in one process", choices=PARALLEL)
    activation_checkpointing: bool = _f(False, "recompute each block in the backward pass (less memory, more time)")
    compile: bool = _f(False, "torch.compile the model")
    progress: Optional[bool] = _f(None, "progress bar; none: only on a terminal (else one line per record)")
    skip_nonfinite: bool = _f(False, "skip (and count) a batch whose loss or gradient is inf or NaN instead of "
                                     "stopping the run; the weights are never updated from it")

    def __post_init__(self):
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "TrainConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def validate(self) -> None:
        """Raise TrainConfigError (a TrainError and a ConfigError) naming the first bad field.

        Checked: vocab_size, seq_len, batch_size, grad_accum, steps, log_every, eval_batches: ints >= 1;
        warmup: int >= 0; max_data_bytes, threads, keep_last: None or int >= 1; seed, save_every,
        eval_every: ints (<= 0: only at the end); lr: finite > 0; min_lr_ratio: [0, 1]; val_fraction:
        [0, 1); weight_decay, grad_clip (0 = off): finite >= 0; beta1, beta2: [0, 1); eps: finite > 0;
        the bool fields; dtype; parallel. `advice()` lists legal but suspicious settings."""
        for name in ("vocab_size", "seq_len", "batch_size", "grad_accum", "steps", "log_every", "eval_batches"):
            _check_int(self, name, 1)
        _check_int(self, "warmup", 0)
        for name in ("max_data_bytes", "threads", "keep_last"):
            _check_int(self, name, 1, optional=True)
        for name in ("seed", "save_every", "eval_every"):
            _check_int(self, name, None)
        _check_float(self, "lr", 0.0, None, low_open=True)
        _check_float(self, "min_lr_ratio", 0.0, 1.0)
        _check_float(self, "val_fraction", 0.0, 1.0, high_open=True, note=" (0: no validation)")
        _check_float(self, "weight_decay", 0.0, None)
        _check_float(self, "beta1", 0.0, 1.0, high_open=True)
        _check_float(self, "beta2", 0.0, 1.0, high_open=True)
        _check_float(self, "eps", 0.0, None, low_open=True)
        _check_float(self, "grad_clip", 0.0, None, note=" (0: no clipping)")
        for name in ("doc_boundaries", "activation_checkpointing", "compile", "skip_nonfinite"):
            if not isinstance(getattr(self, name), bool):
                raise TrainConfigError(name, f"must be true or false, got {getattr(self, name)!r}")
        if self.progress is not None and not isinstance(self.progress, bool):
            raise TrainConfigError("progress", f"must be true, false or none, got {self.progress!r}")
        if not isinstance(self.device, str) or not self.device:
            raise TrainConfigError("device", f"must be auto, cpu, cuda, cuda:N or mps, got {self.device!r}")
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if self.dtype not in DTYPES:
            raise TrainConfigError("dtype", f"must be float32 or bfloat16 (fp32, bf16), got {self.dtype!r}")
        if self.parallel not in PARALLEL:
            raise TrainConfigError("parallel", f"must be one of {', '.join(PARALLEL)}, got {self.parallel!r}")

    def advice(self) -> List[str]:
        """Legal but probably unintended settings, one line each (the CLI prints them as warnings)."""
        notes = []
        if isinstance(self.warmup, int) and isinstance(self.steps, int) and self.warmup > self.steps:
            notes.append(f"TrainConfig.warmup ({self.warmup}) exceeds TrainConfig.steps ({self.steps}): the learning "
                         f"rate never reaches its peak and never decays")
        return notes

    def check_split(self, world_size: int) -> int:
        """Windows per micro-batch in each process.

        Args:
            world_size: The number of processes.

        Returns:
            batch_size / (world_size x grad_accum).

        Raises:
            TrainError: batch_size does not split evenly into world_size processes x grad_accum micro-batches.
        """
        parts = world_size * self.grad_accum
        if self.batch_size % parts:
            raise TrainError(f"batch_size {self.batch_size} (the global batch) must be divisible by the number of "
                             f"processes ({world_size}) x grad_accum ({self.grad_accum}) = {parts}")
        return self.batch_size // parts


def _check_int(cfg: TrainConfig, name: str, low: Optional[int], optional: bool = False) -> None:
    v = getattr(cfg, name)
    if optional and v is None:
        return
    if not isinstance(v, int) or isinstance(v, bool) or (low is not None and v < low):
        what = "an int" + (f" >= {low}" if low is not None else "") + (" or none" if optional else "")
        raise TrainConfigError(name, f"must be {what}, got {v!r}")


def _check_float(cfg: TrainConfig, name: str, low: Optional[float], high: Optional[float], *, low_open: bool = False,
                 high_open: bool = False, note: str = "") -> None:
    v = getattr(cfg, name)
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if ok and low is not None:
        ok = v > low if low_open else v >= low
    if ok and high is not None:
        ok = v < high if high_open else v <= high
    if not ok:
        if low is not None and high is not None:
            what = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        else:
            what = "finite and " + (f"{'>' if low_open else '>='} {low:g}" if low is not None else f"<= {high:g}")
        raise TrainConfigError(name, f"must be {what}{note}, got {v!r}")


def legacy_values(d: Dict[str, Any]) -> Dict[str, Any]:
    """A train config dict saved by an older version, with the values it accepted mapped to their meaning
    today: grad_clip < 0 (no clipping) -> 0, keep_last < 1 (keep all) -> None, threads 0 (torch's default)
    -> None. For checkpoints only: the same values given today are errors."""
    d = dict(d)
    if isinstance(d.get("grad_clip"), (int, float)) and d["grad_clip"] < 0:
        d["grad_clip"] = 0.0
    if isinstance(d.get("keep_last"), int) and d["keep_last"] < 1:
        d["keep_last"] = None
    if d.get("threads") == 0:
        d["threads"] = None
    return d


# Fields that decide the trajectory: a resume must not change them. The rest (steps, logging,
# saving, evaluation, device, threads, progress, out, and how the global batch is computed:
# processes, parallel, grad_accum, activation checkpointing, compile) may change between sessions.
TRAJECTORY_FIELDS = ("seq_len", "batch_size", "lr", "min_lr_ratio", "warmup", "weight_decay",
                     "beta1", "beta2", "eps", "grad_clip", "seed", "val_fraction", "dtype", "doc_boundaries")


def _current_model_dict(d: Dict[str, Any]) -> Dict[str, Any]:
    """A saved model config dict as today's code writes it (an old dict's renamed mixers, `LMConfig.mixer_names`,
    mapped), so that comparing it with a config built from it finds no false mismatch; as it is when it does not
    load (the comparison then names the field)."""
    try:
        return config_to_dict(config_from_dict(dict(d)))
    except (TypeError, ValueError, KeyError):
        return d


def check_resume_compatible(cfg: TrainConfig, saved: Dict[str, Any], model_config: Optional[Dict[str, Any]] = None,
                            saved_model: Optional[Dict[str, Any]] = None) -> None:
    """Raise TrainError naming the first trajectory field (or model field) that differs."""
    saved = legacy_values(saved)
    for k in TRAJECTORY_FIELDS:
        if k in saved and getattr(cfg, k) != saved[k]:
            raise TrainError(f"config/checkpoint mismatch: {k} = {getattr(cfg, k)!r} but the checkpoint "
                             f"was trained with {saved[k]!r}")
    if model_config is not None and saved_model is not None:
        saved_model = _current_model_dict(saved_model)
        for k, v in model_config.items():
            if k in saved_model and saved_model[k] != v and k != "vocab_size":
                raise TrainError(f"config/checkpoint mismatch: model {k} = {v!r} but the checkpoint has "
                                 f"{saved_model[k]!r}")


__all__ = ["TrainConfig", "TrainError", "TrainConfigError", "TrainingDiverged", "legacy_values", "TRAJECTORY_FIELDS",
           "DTYPES", "PARALLEL", "check_resume_compatible", "resolve_device"]
