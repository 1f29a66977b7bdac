"""`TrainConfig`: everything about a training run except the model (that is the model family's
config), with one documented field per setting; the `linattn train` flags are generated from it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import torch

from ..errors import LinattnError

DTYPES = ("float32", "bfloat16")
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16"}
PARALLEL = ("ddp", "fsdp")


class TrainError(LinattnError):
    """A bad request to train/eval (bad config, occupied output folder, mismatched resume)."""


class TrainingDiverged(TrainError, FloatingPointError):
    """The training loss became inf or NaN."""


def _f(default: Any, help: str, **meta: Any) -> Any:
    return field(default=default, metadata={"help": help, **meta})


@dataclass
class TrainConfig:
    """Everything about a run except the model architecture (that is the model config)."""
    data: Optional[str] = _f(None, "text file or folder of UTF-8 text files; none: the Python standard "
                                   "library's .py sources (8 MiB)")
    out: Optional[str] = _f(None, "run folder for checkpoints and metrics.jsonl (none in Python: nothing written)",
                            shown_default="runs/train")
    tokenizer: Optional[str] = _f(None, "tokenizer.json, or a folder or run holding one; none: train a "
                                        "byte-level BPE on the training split")
    vocab_size: int = _f(4096, "vocabulary of a trained tokenizer (an upper bound); the model's vocab_size "
                               "is always the tokenizer's")
    max_data_bytes: Optional[int] = _f(None, "cap on the text read (none: all of a path, 8 MiB of the stdlib)")
    val_fraction: float = _f(0.05, "share of the documents held out for validation")
    seq_len: int = _f(256, "tokens per training window")
    batch_size: int = _f(8, "windows per optimizer step: the global batch, split across processes (torchrun) "
                            "and --grad-accum micro-batches, so the math does not depend on either")
    grad_accum: int = _f(1, "micro-batches per optimizer step in each process (gradients accumulated)")
    doc_boundaries: bool = _f(True, "keep packed documents apart: every mixer's state restarts at each "
                                    "<|endoftext|> (cu_seqlens); false: windows run across documents")
    steps: int = _f(1000, "optimizer steps of the whole run")
    lr: float = _f(1e-3, "peak learning rate")
    min_lr_ratio: float = _f(0.1, "final learning rate / peak, reached by the cosine decay at the last step")
    warmup: int = _f(100, "linear warmup steps")
    weight_decay: float = _f(0.1, "AdamW decoupled weight decay (matrices and embeddings only)")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    eps: float = _f(1e-8, "AdamW epsilon")
    grad_clip: float = _f(1.0, "max gradient norm; <= 0: no clipping")
    seed: int = _f(0, "seed of the initialisation and of the batch order")
    log_every: int = _f(10, "steps per metrics record")
    save_every: int = _f(500, "steps per checkpoint; <= 0: only at the end (and on a signal)")
    eval_every: int = _f(500, "steps per validation; <= 0: only at the end")
    eval_batches: int = _f(20, "validation batches per evaluation")
    keep_last: int = _f(2, "step folders kept in the run folder")
    device: str = _f("auto", "auto | cpu | cuda | cuda:N | mps")
    threads: Optional[int] = _f(None, "torch CPU threads (none: torch's default)")
    dtype: str = _f("float32", "autocast dtype (bf16 = bfloat16); weights and optimizer state stay float32",
                    choices=DTYPES + tuple(DTYPE_ALIASES))
    parallel: str = _f("ddp", "several processes (torchrun): ddp replicates the model, fsdp shards it (FSDP2, "
                              "fully_shard per block); ignored in one process", choices=PARALLEL)
    activation_checkpointing: bool = _f(False, "recompute each block in the backward pass (less memory, more time)")
    compile: bool = _f(False, "torch.compile the model")
    progress: Optional[bool] = _f(None, "progress bar; none: only on a terminal (else one line per record)")

    def __post_init__(self):
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "TrainConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def validate(self) -> None:
        """Raise TrainError naming the first bad field."""
        for name in ("seq_len", "batch_size", "steps", "log_every", "eval_batches", "grad_accum"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if name == "steps" else 1):
                raise TrainError(f"{name} must be a positive int, got {v!r}")
        if not self.lr > 0:
            raise TrainError(f"lr must be positive, got {self.lr}")
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if self.dtype not in DTYPES:
            raise TrainError(f"dtype must be float32 or bfloat16 (fp32, bf16), got {self.dtype!r}")
        if self.parallel not in PARALLEL:
            raise TrainError(f"parallel must be one of {', '.join(PARALLEL)}, got {self.parallel!r}")

    def check_split(self, world_size: int) -> int:
        """Windows per micro-batch in each process; raise TrainError unless batch_size splits evenly
        into world_size processes x grad_accum micro-batches."""
        parts = world_size * self.grad_accum
        if self.batch_size % parts:
            raise TrainError(f"batch_size {self.batch_size} (the global batch) must be divisible by the number of "
                             f"processes ({world_size}) x grad_accum ({self.grad_accum}) = {parts}")
        return self.batch_size // parts


# Fields that decide the trajectory: a resume must not change them. The rest (steps, logging,
# saving, evaluation, device, threads, progress, out, and how the global batch is computed:
# processes, parallel, grad_accum, activation checkpointing, compile) may change between sessions.
TRAJECTORY_FIELDS = ("seq_len", "batch_size", "lr", "min_lr_ratio", "warmup", "weight_decay",
                     "beta1", "beta2", "eps", "grad_clip", "seed", "val_fraction", "dtype", "doc_boundaries")


def check_resume_compatible(cfg: TrainConfig, saved: Dict[str, Any], model_config: Optional[Dict[str, Any]] = None,
                            saved_model: Optional[Dict[str, Any]] = None) -> None:
    """Raise TrainError naming the first trajectory field (or model field) that differs."""
    for k in TRAJECTORY_FIELDS:
        if k in saved and getattr(cfg, k) != saved[k]:
            raise TrainError(f"config/checkpoint mismatch: {k} = {getattr(cfg, k)!r} but the checkpoint "
                             f"was trained with {saved[k]!r}")
    if model_config is not None and saved_model is not None:
        for k, v in model_config.items():
            if k in saved_model and saved_model[k] != v and k != "vocab_size":
                raise TrainError(f"config/checkpoint mismatch: model {k} = {v!r} but the checkpoint has "
                                 f"{saved_model[k]!r}")


def resolve_device(name: Optional[str]) -> torch.device:
    """`auto` (or None): CUDA when available, else the CPU; otherwise the named device."""
    if name in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise TrainError(f"unknown device {name!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise TrainError(f"device {name!r} requested but CUDA is not available")
    return dev


__all__ = ["TrainConfig", "TrainError", "TrainingDiverged", "TRAJECTORY_FIELDS", "DTYPES", "PARALLEL",
           "check_resume_compatible", "resolve_device"]
