"""Language-model training, evaluation and training-throughput measurement, with the
`linattn train` / `linattn eval` command lines.

Python API (what experiments reuse):

    from linattn.train import TrainConfig, train, evaluate, prepare_data, training_tokens_per_second
    cfg = TrainConfig(data="corpus/", out="runs/efla", seq_len=256, batch_size=8, steps=2000)
    res = train(cfg, LMConfig(vocab_size=4096, d_model=256, n_layers=4, n_heads=4, mixer="efla"))
    res.val_loss, res.tokens_per_s, res.model
    evaluate(res.model, prepare_data(cfg).val)           # -> EvalResult(loss, ppl, tokens, batches)
    training_tokens_per_second(model_config, seq_len=512, batch_size=2)   # median tokens/s

What a run does: reads the data (a file, a folder, or with no data the Python standard library,
see `linattn.data.corpus`), trains a byte-level BPE tokenizer on the training split (or loads one),
packs the documents into `seq_len` windows, and trains with AdamW (decoupled weight decay on
matrices only), linear warmup then cosine decay to `min_lr_ratio * lr`, gradient-norm clipping,
periodic validation loss/perplexity, a tqdm bar with tokens/s, `out/metrics.jsonl`, and atomic
checkpoints (`linattn.checkpoint`).

Exact resume: the batch of step s is a pure function of (seed, s) (`PackedTokens.get_batch`), and
a checkpoint holds the weights, the optimizer state, the step (the LR schedule is a function of
the step), the torch RNG states and the loss accumulator of the current logging interval. So
`--resume` after an interruption reproduces the uninterrupted run's weights (bitwise on CPU).
SIGINT/SIGTERM during training finish the current step, save, and return (`interrupted=True`;
the CLI exits with 128 + the signal number); a second SIGINT aborts at once (the last complete
checkpoint stays intact).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from . import checkpoint as ckpt_mod
from .checkpoint import CheckpointError
from .data.corpus import (CorpusError, PackedTokens, load_corpus, split_documents, token_fingerprint,
                          tokenize_documents)
from .data.tokenizer import BPETokenizer, TokenizerError, load_tokenizer, train_tokenizer
from .errors import LinattnError

METRICS_FILE = "metrics.jsonl"


class TrainError(LinattnError):
    """A bad request to train/eval (bad config, occupied output folder, mismatched resume)."""


# Errors that the command lines turn into a one-line message and exit code 2.
USER_ERRORS = (TrainError, CorpusError, TokenizerError, CheckpointError)


@dataclass
class TrainConfig:
    """Everything about a run except the model architecture (that is the LMConfig)."""
    data: Optional[str] = None            # text file or folder; None: the stdlib corpus
    out: Optional[str] = None             # run folder for checkpoints + metrics.jsonl; None: none written
    tokenizer: Optional[str] = None       # tokenizer.json (or a folder/checkpoint holding one); None: train one
    vocab_size: int = 4096                # for a trained tokenizer (an upper bound)
    max_data_bytes: Optional[int] = None  # cap on the text read (None: all of a path; 8 MiB of stdlib)
    val_fraction: float = 0.05
    seq_len: int = 256
    batch_size: int = 8
    steps: int = 1000
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0                # <= 0: no clipping
    seed: int = 0
    log_every: int = 10
    save_every: int = 500                 # <= 0: save only at the end (and on a signal)
    eval_every: int = 500                 # <= 0: validate only at the end
    eval_batches: int = 20
    keep_last: int = 2                    # step folders kept in `out`
    device: str = "auto"                  # auto | cpu | cuda | cuda:N | mps
    threads: Optional[int] = None         # torch.set_num_threads
    dtype: str = "float32"                # float32 | bfloat16 (autocast; master weights stay fp32)
    progress: Optional[bool] = None       # tqdm bar; None: only on a terminal

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "TrainConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


# Fields that decide the trajectory: a resume must not change them. The rest (steps, logging,
# saving, evaluation, device, threads, progress, out) may change between sessions of one run.
TRAJECTORY_FIELDS = ("seq_len", "batch_size", "lr", "min_lr_ratio", "warmup", "weight_decay",
                     "beta1", "beta2", "eps", "grad_clip", "seed", "val_fraction", "dtype")


@dataclass
class EvalResult:
    loss: float
    ppl: float
    tokens: int
    batches: int

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class TrainData:
    tokenizer: BPETokenizer
    train: PackedTokens
    val: Optional[PackedTokens]
    fingerprint: str
    source: str


@dataclass
class TrainResult:
    step: int                             # steps completed
    model: torch.nn.Module
    model_config: Any
    tokenizer: BPETokenizer
    losses: List[Tuple[int, float]]       # (step, training loss) of every step run in this call
    val_loss: Optional[float] = None
    val_ppl: Optional[float] = None
    tokens_per_s: Optional[float] = None  # training tokens/s of this call (first step excluded)
    elapsed_s: float = 0.0
    checkpoint: Optional[Path] = None
    interrupted: bool = False
    signal: Optional[int] = None
    resumed_from: Optional[int] = None
    history: List[Dict[str, Any]] = field(default_factory=list)   # the metrics records written


# --------------------------------------------------------------------------- small helpers

def resolve_device(name: Optional[str]) -> torch.device:
    if name in (None, "", "auto"):
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise TrainError(f"unknown device {name!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise TrainError(f"device {name!r} requested but CUDA is not available")
    return dev


def _autocast(device: torch.device, dtype: str):
    if dtype in ("float32", "fp32", None):
        return torch.autocast(device_type=device.type, enabled=False)
    if dtype in ("bfloat16", "bf16"):
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    raise TrainError(f"dtype must be float32 or bfloat16, got {dtype!r}")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of 0-based `step`: linear warmup over `warmup` steps, then cosine to min_lr."""
    if cfg.warmup > 0 and step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(1, cfg.steps - cfg.warmup)
    t = min(1.0, max(0.0, (step - cfg.warmup) / span))
    lo = cfg.lr * cfg.min_lr_ratio
    return lo + 0.5 * (cfg.lr - lo) * (1.0 + math.cos(math.pi * t))


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; weight decay on parameters with >= 2 dims (matrices, embeddings), none on gains/biases."""
    decay, no_decay, seen = [], [], set()
    for _, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             eps=cfg.eps, foreach=False)


def _model_output(out) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(logits, aux_loss) from a model's forward output (an object, a tuple, or a tensor)."""
    if isinstance(out, torch.Tensor):
        return out, None
    if isinstance(out, (tuple, list)):
        return out[0], (out[1] if len(out) > 1 else None)
    return out.logits, getattr(out, "aux_loss", None)


def _as_float(x) -> float:
    return float(x.detach().float().item()) if isinstance(x, torch.Tensor) else float(x)


def count_parameters(model: torch.nn.Module) -> int:
    seen, n = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            n += p.numel()
    return n


def _default_factory(model_config) -> torch.nn.Module:
    return ckpt_mod.build_model(model_config)


def _config_dict(model_config) -> Dict[str, Any]:
    if isinstance(model_config, dict):
        return dict(model_config)
    return ckpt_mod.model_config_to_dict(model_config)


def _with_vocab(model_config, vocab_size: int):
    """The model config with the tokenizer's vocab_size (dict or dataclass)."""
    cur = model_config.get("vocab_size") if isinstance(model_config, dict) else getattr(model_config, "vocab_size", None)
    if cur == vocab_size:
        return model_config
    if isinstance(model_config, dict):
        return {**model_config, "vocab_size": vocab_size}
    return dataclasses.replace(model_config, vocab_size=vocab_size)


# --------------------------------------------------------------------------- data

def prepare_data(cfg: TrainConfig, tokenizer: Optional[BPETokenizer] = None) -> TrainData:
    """Read, split, tokenize and pack the run's data. The tokenizer is `tokenizer`, else the one at
    `cfg.tokenizer`, else one trained on the training split with `cfg.vocab_size`."""
    docs = load_corpus(cfg.data, max_bytes=cfg.max_data_bytes)
    train_docs, val_docs = split_documents(docs, cfg.val_fraction)
    if tokenizer is None:
        if cfg.tokenizer:
            tokenizer = load_tokenizer(cfg.tokenizer)
        else:
            tokenizer = train_tokenizer((d.text for d in train_docs), vocab_size=cfg.vocab_size)
    train_tok = tokenize_documents(train_docs, tokenizer)
    train = PackedTokens(train_tok, cfg.seq_len, name="the training data")
    train.check_trainable()
    val = None
    if val_docs:
        vt = tokenize_documents(val_docs, tokenizer)
        val = PackedTokens(vt, cfg.seq_len, name="the validation data") if vt.numel() >= 2 else None
    fp = token_fingerprint(train_tok) + ("/" + token_fingerprint(val.tokens) if val is not None else "")
    return TrainData(tokenizer=tokenizer, train=train, val=val, fingerprint=fp,
                     source=cfg.data if cfg.data is not None else "stdlib")


# --------------------------------------------------------------------------- evaluation

@torch.no_grad()
def evaluate(model: torch.nn.Module, data: Union[PackedTokens, torch.Tensor], *, batch_size: int = 8,
             max_batches: Optional[int] = None, seq_len: Optional[int] = None,
             device: Optional[Union[str, torch.device]] = None, dtype: str = "float32") -> EvalResult:
    """Mean next-token cross-entropy (nats/token) and perplexity of `model` on `data`.

    `data` is a PackedTokens (its windows in order) or a 1-D token tensor (cut into `seq_len`
    windows). Deterministic; the model's train/eval mode is restored afterwards.
    """
    if isinstance(data, torch.Tensor):
        if seq_len is None:
            raise TrainError("evaluate(tensor) needs seq_len")
        data = PackedTokens(data, seq_len, name="the evaluation data")
    if device is None:
        try:
            device = next(model.parameters()).device
        except StopIteration:
            device = torch.device("cpu")
    device = torch.device(device)
    was_training = model.training
    model.eval()
    total, count, nb = 0.0, 0, 0
    try:
        for x, y in data.eval_batches(batch_size, max_batches):
            x, y = x.to(device), y.to(device)
            with _autocast(device, dtype):
                logits, _ = _model_output(model(x))
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum")
            total += float(loss.item())
            count += y.numel()
            nb += 1
    finally:
        model.train(was_training)
    if count == 0:
        raise CorpusError("no evaluation windows")
    mean = total / count
    return EvalResult(loss=mean, ppl=math.exp(min(mean, 700.0)), tokens=count, batches=nb)


# --------------------------------------------------------------------------- signals

class _StopFlag:
    """SIGINT/SIGTERM -> finish the step, save, stop. A second SIGINT raises KeyboardInterrupt."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.signum: Optional[int] = None
        self._old: Dict[int, Any] = {}

    def _handler(self, signum, frame):
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
        print(f"\n[linattn] {signal.Signals(signum).name}: finishing the current step, saving, exiting "
              f"(SIGINT again aborts at once; the last checkpoint stays intact)", file=sys.stderr, flush=True)

    def __enter__(self):
        if self.enabled:
            for s in (signal.SIGINT, signal.SIGTERM):
                try:
                    self._old[s] = signal.signal(s, self._handler)
                except (ValueError, OSError):
                    pass
        return self

    def __exit__(self, *exc):
        for s, h in self._old.items():
            try:
                signal.signal(s, h)
            except (ValueError, OSError):
                pass
        return False


# --------------------------------------------------------------------------- the run folder

def _check_out_dir(out: Path, resume: bool, overwrite: bool) -> Optional[Path]:
    """Refuse an occupied run folder unless resume/overwrite; return the checkpoint to resume."""
    if out.exists() and not out.is_dir():
        raise TrainError(f"--out {out} exists and is not a folder")
    latest = ckpt_mod.find_latest_checkpoint(out) if out.is_dir() else None
    if resume:
        if latest is None and out.is_dir() and (out / ckpt_mod.LATEST_FILE).exists():
            raise CheckpointError(f"{out} has a 'latest' pointer but no complete checkpoint to resume")
        return latest
    occupied = latest is not None or (out / ckpt_mod.LATEST_FILE).exists() or (out / METRICS_FILE).exists()
    if occupied and not overwrite:
        what = f"a checkpoint (step {ckpt_mod.read_checkpoint_config(latest).get('step')})" if latest else "a previous run"
        raise TrainError(f"{out} already holds {what}; pass --resume to continue it or --overwrite to start over")
    return None


def _clear_run_dir(out: Path) -> None:
    import shutil

    for p in ckpt_mod.list_checkpoints(out):
        shutil.rmtree(p, ignore_errors=True)
    for p in out.glob(ckpt_mod.STEP_PREFIX + "*"):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
    for name in (ckpt_mod.LATEST_FILE, METRICS_FILE):
        if (out / name).exists():
            (out / name).unlink()


def _read_metrics(path: Path) -> List[Dict[str, Any]]:
    recs = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            line = line.strip()
            if not line:
                continue
            try:
                recs.append(json.loads(line))
            except ValueError:
                break  # a torn last line from a kill mid-write
    return recs


def read_metrics(run_dir_or_file: Union[str, os.PathLike]) -> List[Dict[str, Any]]:
    """The records of a run's metrics.jsonl (a torn last line is dropped)."""
    p = Path(run_dir_or_file)
    return _read_metrics(p / METRICS_FILE if p.is_dir() else p)


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
                raise TrainError(f"config/checkpoint mismatch: model {k} = {v!r} but the checkpoint has {saved_model[k]!r}")


# --------------------------------------------------------------------------- training

def train(config: TrainConfig, model_config=None, *, resume: bool = False, overwrite: bool = False,
          data: Optional[TrainData] = None, tokenizer: Optional[BPETokenizer] = None,
          model_factory: Optional[Callable[[Any], torch.nn.Module]] = None,
          should_stop: Optional[Callable[[int], bool]] = None, handle_signals: bool = True,
          on_log: Optional[Callable[[Dict[str, Any]], None]] = None) -> TrainResult:
    """Train a language model; see the module docstring.

    model_config: an LMConfig (or a dict for `model_factory`); its vocab_size is set to the
        tokenizer's. On resume it may be None (the checkpoint's is used).
    resume: continue from `config.out`'s latest checkpoint (a fresh start when there is none).
    overwrite: clear an occupied `config.out` (else it is refused with TrainError).
    data: prepared data (`prepare_data`), to share one tokenization across runs.
    should_stop(step_done) -> bool: polled after every step, like a signal: save and stop.
    on_log(record): called with every metrics record.
    """
    cfg = config
    for name in ("seq_len", "batch_size", "steps", "log_every", "eval_batches"):
        v = getattr(cfg, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < (0 if name == "steps" else 1):
            raise TrainError(f"{name} must be a positive int, got {v!r}")
    if not cfg.lr > 0:
        raise TrainError(f"lr must be positive, got {cfg.lr}")
    _autocast(torch.device("cpu"), cfg.dtype)  # validates dtype
    device = resolve_device(cfg.device)
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    factory = model_factory or _default_factory

    out = Path(cfg.out) if cfg.out else None
    resume_ck: Optional[Path] = None
    if out is not None:
        resume_ck = _check_out_dir(out, resume, overwrite)
    elif resume:
        raise TrainError("resume needs an output folder (config.out)")

    saved_meta: Dict[str, Any] = {}
    if resume_ck is not None:
        saved_meta = ckpt_mod.read_checkpoint_config(resume_ck)
        check_resume_compatible(cfg, saved_meta.get("train", {}),
                                _config_dict(model_config) if model_config is not None else None,
                                saved_meta.get("model"))
        if tokenizer is None and data is None:
            tokenizer = load_tokenizer(resume_ck)
        if model_config is None:
            model_config = saved_meta["model"] if model_factory is not None else \
                ckpt_mod.model_config_from_dict(saved_meta["model"])
    if model_config is None:
        raise TrainError("a model config is needed (none given and no checkpoint to resume)")

    chatty = cfg.progress is not False
    if data is None:
        t_data = time.perf_counter()
        data = prepare_data(cfg, tokenizer)
        if chatty:
            print(f"[linattn] data {data.source}: {data.train.n_tokens:,} training tokens"
                  + (f", {data.val.n_tokens:,} validation tokens" if data.val is not None else "")
                  + f", vocab {data.tokenizer.vocab_size} ({time.perf_counter() - t_data:.1f} s)",
                  file=sys.stderr, flush=True)
    if data.train.seq_len != cfg.seq_len:
        raise TrainError(f"data packed for seq_len {data.train.seq_len}, config says {cfg.seq_len}")
    if resume_ck is not None:
        saved_fp = saved_meta.get("data_fingerprint")
        if saved_fp and saved_fp != data.fingerprint:
            raise TrainError(f"config/checkpoint mismatch: the data (or tokenizer) differs from the run's "
                             f"({data.fingerprint} vs {saved_fp}); pass the same --data")
    if resume_ck is not None:
        saved_vocab = (saved_meta.get("model") or {}).get("vocab_size")
        if saved_vocab is not None and saved_vocab != data.tokenizer.vocab_size:
            raise TrainError(f"config/checkpoint mismatch: the checkpoint's model has vocab_size {saved_vocab}, "
                             f"the tokenizer {data.tokenizer.vocab_size}")
    model_config = _with_vocab(model_config, data.tokenizer.vocab_size)

    torch.manual_seed(cfg.seed)
    try:
        model = factory(model_config)
    except (TypeError, ValueError, KeyError) as e:
        raise TrainError(f"cannot build the model: {e}") from None
    model.to(device)
    opt = make_optimizer(model, cfg)
    start = 0
    loss_acc = [0.0, 0]
    tokens_seen = 0
    elapsed_before = 0.0
    if resume_ck is not None:
        ckpt_mod.load_model_weights(model, resume_ck, device="cpu")
        model.to(device)
        state = ckpt_mod.load_training_state(resume_ck)
        try:
            opt.load_state_dict(state["optimizer"])
        except (ValueError, KeyError, RuntimeError) as e:
            raise CheckpointError(f"optimizer state in {resume_ck} does not fit the model: {e}") from None
        start = int(state["step"])
        loss_acc = list(state.get("loss_acc", [0.0, 0]))
        tokens_seen = int(state.get("tokens_seen", 0))
        elapsed_before = float(state.get("elapsed_s", 0.0))
        torch.set_rng_state(state["torch_rng"])
        if state.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(list(state["cuda_rng"]))

    # Everything that can fail on bad input has run: only now is the run folder touched.
    history: List[Dict[str, Any]] = []
    metrics_path = None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        metrics_path = out / METRICS_FILE
        if resume_ck is not None:
            kept = [r for r in _read_metrics(metrics_path) if int(r.get("step", 0)) <= start]
            ckpt_mod.atomic_write_text(metrics_path, "".join(json.dumps(r) + "\n" for r in kept))
        else:
            _clear_run_dir(out)
            metrics_path.touch()

    model_dict = _config_dict(model_config)
    train_dict = cfg.to_dict()

    def save(step_done: int) -> Optional[Path]:
        if out is None:
            return None
        state = {"step": step_done, "optimizer": opt.state_dict(), "torch_rng": torch.get_rng_state(),
                 "cuda_rng": torch.cuda.get_rng_state_all() if device.type == "cuda" else None,
                 "loss_acc": list(loss_acc), "tokens_seen": tokens_seen,
                 "elapsed_s": elapsed_before + (time.perf_counter() - t_start)}
        return ckpt_mod.save_checkpoint(out, step_done, model, model_config=model_dict, tokenizer=data.tokenizer,
                                        train_config=train_dict, training_state=state,
                                        extra={"data_fingerprint": data.fingerprint, "data_source": data.source,
                                               "n_params": count_parameters(model)},
                                        keep_last=cfg.keep_last)

    def log(rec: Dict[str, Any]) -> None:
        history.append(rec)
        if metrics_path is not None:
            with open(metrics_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")
        if on_log is not None:
            on_log(rec)

    def validate() -> Optional[EvalResult]:
        if data.val is None:
            return None
        return evaluate(model, data.val, batch_size=cfg.batch_size, max_batches=cfg.eval_batches,
                        device=device, dtype=cfg.dtype)

    from tqdm.auto import tqdm

    tokens_per_step = cfg.batch_size * cfg.seq_len
    echo = cfg.progress is None and not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty())
    if chatty:
        print(f"[linattn] model: {count_parameters(model):,} parameters on {device}; "
              + (f"resuming at step {start}" if resume_ck is not None else "new run")
              + (f" in {out}" if out is not None else ""), file=sys.stderr, flush=True)
    losses: List[Tuple[int, float]] = []
    step_times: List[float] = []
    last_ckpt: Optional[Path] = resume_ck
    val_res: Optional[EvalResult] = None
    interrupted = False
    stop = _StopFlag(handle_signals)
    model.train()
    bar = tqdm(total=cfg.steps, initial=min(start, cfg.steps), desc="train", unit="step", dynamic_ncols=True,
               disable=(None if cfg.progress is None else not cfg.progress), leave=True)
    t_start = time.perf_counter()
    t_int, tok_int = time.perf_counter(), 0
    step_done = start
    try:
        with stop:
            for step in range(start, cfg.steps):
                t0 = time.perf_counter()
                lr = lr_at(step, cfg)
                for g in opt.param_groups:
                    g["lr"] = lr
                x, y = data.train.get_batch(step, cfg.batch_size, cfg.seed)
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with _autocast(device, cfg.dtype):
                    logits, aux = _model_output(model(x))
                loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
                total = loss + aux.float() if isinstance(aux, torch.Tensor) else loss
                opt.zero_grad(set_to_none=True)
                total.backward()
                gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip) \
                    if cfg.grad_clip and cfg.grad_clip > 0 else None
                opt.step()
                lval = _as_float(loss)
                if not math.isfinite(lval):
                    raise FloatingPointError(f"training loss is {lval} at step {step + 1}")
                step_done = step + 1
                losses.append((step_done, lval))
                loss_acc[0] += lval
                loss_acc[1] += 1
                tokens_seen += tokens_per_step
                tok_int += tokens_per_step
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                step_times.append(time.perf_counter() - t0)
                bar.update(1)

                last = step_done == cfg.steps
                do_eval = (cfg.eval_every > 0 and step_done % cfg.eval_every == 0) or last
                if step_done % cfg.log_every == 0 or do_eval or last:
                    now = time.perf_counter()
                    rec = {"step": step_done, "loss": loss_acc[0] / max(1, loss_acc[1]), "last_loss": lval,
                           "lr": lr, "tokens": tokens_seen,
                           "tokens_per_s": tok_int / max(1e-9, now - t_int),
                           "elapsed_s": elapsed_before + now - t_start}
                    if gnorm is not None:
                        rec["grad_norm"] = _as_float(gnorm)
                    if isinstance(aux, torch.Tensor):
                        rec["aux_loss"] = _as_float(aux)
                    if do_eval:
                        val_res = validate()
                        if val_res is not None:
                            rec["val_loss"], rec["val_ppl"] = val_res.loss, val_res.ppl
                    log(rec)
                    if echo:  # no progress bar (not a terminal): one line per logged step
                        print(f"step {step_done}/{cfg.steps} loss {rec['loss']:.4f}"
                              + (f" val_loss {rec['val_loss']:.4f}" if "val_loss" in rec else "")
                              + f" lr {lr:.2e} tok/s {rec['tokens_per_s']:.0f}", file=sys.stderr, flush=True)
                    bar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}",
                                    **({"val": f"{val_res.loss:.3f}"} if do_eval and val_res else {}))
                    loss_acc = [0.0, 0]
                    t_int, tok_int = time.perf_counter(), 0
                stopping = stop.signum is not None or (should_stop is not None and should_stop(step_done))
                if (cfg.save_every > 0 and step_done % cfg.save_every == 0) or last or stopping:
                    last_ckpt = save(step_done) or last_ckpt
                    t_int = time.perf_counter()  # saving is not training time
                if stopping and not last:
                    interrupted = True
                    break
    finally:
        bar.close()
    elapsed = time.perf_counter() - t_start
    timed = step_times[1:] if len(step_times) > 1 else step_times
    tps = tokens_per_step * len(timed) / sum(timed) if timed and sum(timed) > 0 else None
    if val_res is None and not interrupted and data.val is not None and start >= cfg.steps:
        val_res = validate()
    return TrainResult(step=step_done, model=model, model_config=model_config, tokenizer=data.tokenizer,
                       losses=losses, val_loss=val_res.loss if val_res else None,
                       val_ppl=val_res.ppl if val_res else None, tokens_per_s=tps, elapsed_s=elapsed,
                       checkpoint=last_ckpt, interrupted=interrupted, signal=stop.signum,
                       resumed_from=start if resume_ck is not None else None, history=history)


# --------------------------------------------------------------------------- throughput

def training_tokens_per_second(model_config, *, seq_len: int = 512, batch_size: int = 2, steps: int = 5,
                               warmup: int = 2, device: Optional[str] = None, dtype: str = "float32",
                               lr: float = 1e-4, seed: int = 0,
                               model_factory: Optional[Callable[[Any], torch.nn.Module]] = None,
                               return_all: bool = False):
    """Median training tokens/s (forward + backward + clip + AdamW step) on random tokens.

    Builds the model from `model_config` (or takes an nn.Module), runs `warmup` untimed steps,
    then `steps` timed ones. Returns the median tokens/s, or with return_all a dict with the
    per-step times, the parameter count and the median.
    """
    dev = resolve_device(device)
    torch.manual_seed(seed)
    if isinstance(model_config, torch.nn.Module):
        model = model_config
    else:
        model = (model_factory or _default_factory)(model_config)
    model.to(dev).train()
    vocab = (model_config.get("vocab_size") if isinstance(model_config, dict)
             else getattr(model_config, "vocab_size", None))
    if vocab is None:
        vocab = model.get_input_embeddings().num_embeddings if hasattr(model, "get_input_embeddings") else 256
    cfg = TrainConfig(lr=lr, steps=warmup + steps, warmup=0, seq_len=seq_len, batch_size=batch_size)
    opt = make_optimizer(model, cfg)
    g = torch.Generator().manual_seed(seed)
    times = []
    for i in range(warmup + steps):
        x = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=g).to(dev)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        with _autocast(dev, dtype):
            logits, aux = _model_output(model(x[:, :-1]))
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        if isinstance(aux, torch.Tensor):
            loss = loss + aux.float()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    med = batch_size * seq_len / statistics.median(times)
    if return_all:
        return {"tokens_per_s": med, "step_s": times, "n_params": count_parameters(model),
                "seq_len": seq_len, "batch_size": batch_size, "device": str(dev)}
    return med


# --------------------------------------------------------------------------- command lines

DESCRIPTION = """\
Train a language model. Reads --data (a text file, or every UTF-8 text file under a folder; with
no --data the Python standard library's .py sources, capped at 8 MiB), trains a byte-level BPE
tokenizer on the training split (or loads --tokenizer), packs the documents into --seq-len
windows, and trains with AdamW, warmup + cosine decay and gradient clipping. Writes
OUT/metrics.jsonl and atomic checkpoints OUT/step_N/ (safetensors weights, config.json,
tokenizer.json, optimizer/RNG state). SIGINT/SIGTERM finish the step, save and exit (code 128+N);
--resume continues exactly where the run stopped.

example: linattn train --data corpus/ --out runs/efla --mixer efla --d-model 256 --n-layers 4 \\
             --n-heads 4 --seq-len 256 --batch-size 8 --steps 2000
"""

_MODEL_FLAGS = ("d_model", "n_layers", "n_heads", "ffn", "n_experts", "top_k", "moe_bias", "residual",
                "memory_lobe", "allow_future_leak", "tie_embeddings", "final_norm",
                "n_blocks", "inner_depth", "history_window", "generation_window")  # the last four: tlinformer


def _bool_flag(s: str) -> bool:
    v = s.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {s!r}")


def _window_flag(s: str):
    if s.strip().lower() == "auto":
        return "auto"
    try:
        return int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int or 'auto', got {s!r}") from None


def _lobe_flag(s: str) -> Optional[str]:
    return None if s.strip().lower() in ("none", "off", "false", "0", "") else s


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `linattn train` (model flags default to None: the LMConfig default, or on --resume
    the checkpoint's value)."""
    d = TrainConfig()
    g = p.add_argument_group("data")
    g.add_argument("--data", default=None, help="text file or folder (default: the Python standard library's "
                                                "sources, capped at 8 MiB)")
    g.add_argument("--tokenizer", default=None, help="tokenizer.json to use (default: train a byte-level BPE)")
    g.add_argument("--vocab-size", type=int, default=None, help=f"BPE vocabulary to train (default {d.vocab_size})")
    g.add_argument("--max-data-bytes", type=int, default=None, help="cap on the text read")
    g.add_argument("--val-fraction", type=float, default=None, help=f"validation share (default {d.val_fraction})")
    g = p.add_argument_group("model")
    g.add_argument("--preset", default=None, help="a model preset from linattn.models (then flags override it)")
    g.add_argument("--model-config", default=None, help="JSON file with an LMConfig dict (flags override it)")
    g.add_argument("--mixer", default=None, help="sequence mixer name, or a comma list, one per layer (see "
                                                 "linattn.mixers())")
    g.add_argument("--d-model", type=int, default=None)
    g.add_argument("--n-layers", type=int, default=None)
    g.add_argument("--n-heads", type=int, default=None)
    g.add_argument("--ffn", default=None, help="swiglu | moe | none")
    g.add_argument("--n-experts", type=int, default=None, help="MoE experts")
    g.add_argument("--top-k", type=int, default=None, help="MoE experts per token")
    g.add_argument("--moe-bias", default=None, help="none | eq14 | eq15 (ELA expert label bias)")
    g.add_argument("--residual", default=None, help="prenorm | hyperlink")
    g.add_argument("--memory-lobe", default=None, type=_lobe_flag, help="none | causal | bidirectional")
    g.add_argument("--allow-future-leak", default=None, type=_bool_flag, help="true/false")
    g.add_argument("--tie-embeddings", default=None, type=_bool_flag, help="true/false")
    g.add_argument("--final-norm", default=None, type=_bool_flag, help="true/false")
    g.add_argument("--model", default=None, choices=("lm", "tlinformer"),
                   help="lm: LanguageModel (default); tlinformer: TLinFormerLM, with the four flags below")
    g.add_argument("--n-blocks", type=int, default=None, help="tlinformer: stacked blocks")
    g.add_argument("--inner-depth", type=int, default=None, help="tlinformer: layers per block (>= 2)")
    g.add_argument("--history-window", type=_window_flag, default=None, help="tlinformer: W_oh, an int or auto")
    g.add_argument("--generation-window", type=int, default=None, help="tlinformer: W_og (<= --seq-len)")
    g = p.add_argument_group("optimization")
    g.add_argument("--seq-len", type=int, default=None, help=f"default {d.seq_len}")
    g.add_argument("--batch-size", type=int, default=None, help=f"default {d.batch_size}")
    g.add_argument("--steps", type=int, default=None, help=f"default {d.steps}")
    g.add_argument("--lr", type=float, default=None, help=f"peak learning rate (default {d.lr})")
    g.add_argument("--min-lr-ratio", type=float, default=None, help=f"final lr / peak (default {d.min_lr_ratio})")
    g.add_argument("--warmup", type=int, default=None, help=f"warmup steps (default {d.warmup})")
    g.add_argument("--weight-decay", type=float, default=None, help=f"default {d.weight_decay}")
    g.add_argument("--grad-clip", type=float, default=None, help=f"max grad norm, 0 = off (default {d.grad_clip})")
    g.add_argument("--seed", type=int, default=None, help=f"default {d.seed}")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="autocast dtype")
    g = p.add_argument_group("run")
    g.add_argument("--out", default=None, help="run folder for checkpoints and metrics.jsonl (default runs/train)")
    g.add_argument("--resume", action="store_true", help="continue --out's latest checkpoint (fresh if none)")
    g.add_argument("--overwrite", action="store_true", help="start over in an --out that holds a previous run")
    g.add_argument("--log-every", type=int, default=None, help=f"default {d.log_every}")
    g.add_argument("--save-every", type=int, default=None, help=f"default {d.save_every}")
    g.add_argument("--eval-every", type=int, default=None, help=f"default {d.eval_every}")
    g.add_argument("--eval-batches", type=int, default=None, help=f"default {d.eval_batches}")
    g.add_argument("--keep-last", type=int, default=None, help=f"checkpoints kept (default {d.keep_last})")
    g.add_argument("--device", default=None, help="auto | cpu | cuda (default auto)")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


_TRAIN_FLAGS = ("data", "tokenizer", "vocab_size", "max_data_bytes", "val_fraction", "seq_len", "batch_size",
                "steps", "lr", "min_lr_ratio", "warmup", "weight_decay", "grad_clip", "seed", "dtype", "out",
                "log_every", "save_every", "eval_every", "eval_batches", "keep_last", "device", "threads")


def _fail(msg: str) -> int:
    msg = " ".join(str(msg).split())
    print(f"linattn: error: {msg}", file=sys.stderr)
    return 2


def _available_mixers() -> Optional[List[str]]:
    try:
        from .models.registry import mixers
    except ImportError:
        return None
    return list(mixers())


def check_mixer(mixer) -> None:
    names = mixer if isinstance(mixer, (list, tuple)) else [mixer]
    avail = _available_mixers()
    if avail is None:
        return
    for m in names:
        if m not in avail:
            raise TrainError(f"unknown mixer {m!r}; available: {', '.join(avail)}")


def _model_config_from_args(args, base: Optional[Dict[str, Any]], seq_len: int):
    """LMConfig from --preset / --model-config / flags (flags win), raising TrainError on bad values."""
    from . import models

    d: Dict[str, Any] = dict(base or {})
    if getattr(args, "preset", None):
        presets = getattr(models, "PRESETS", None)
        if presets is None:
            from .models.config import PRESETS as presets
        if args.preset not in presets:
            raise TrainError(f"unknown preset {args.preset!r}; available: {', '.join(sorted(presets))}")
        pc = presets[args.preset]
        pc = pc() if callable(pc) else pc
        d.update(ckpt_mod.model_config_to_dict(pc) if not isinstance(pc, dict) else pc)
    if getattr(args, "model_config", None):
        try:
            d.update(json.loads(Path(args.model_config).read_text(encoding="utf-8")))
        except (OSError, ValueError) as e:
            raise TrainError(f"cannot read --model-config {args.model_config}: {e}") from None
    if args.mixer is not None:
        mix = [m.strip() for m in args.mixer.split(",") if m.strip()]
        d["mixer"] = mix[0] if len(mix) == 1 else mix
    for k in _MODEL_FLAGS:
        v = getattr(args, k, None)
        if v is not None:
            d[k] = v
    if getattr(args, "model", None) == "tlinformer":
        d["arch"] = "tlinformer"
    d.setdefault("vocab_size", getattr(args, "vocab_size", None) or TrainConfig.vocab_size)
    if "mixer" in d:
        check_mixer(d["mixer"])
    if d.get("max_seq_len") is None or d["max_seq_len"] < seq_len:
        d["max_seq_len"] = seq_len
    try:
        if d.get("arch") == "tlinformer":
            return models.TLinFormerConfig.from_dict(d)
        return models.LMConfig.from_dict(d)
    except (TypeError, ValueError) as e:
        raise TrainError(str(e)) from None


def _explicit_model_dict(args) -> Dict[str, Any]:
    d = {k: getattr(args, k) for k in _MODEL_FLAGS if getattr(args, k, None) is not None}
    if args.mixer is not None:
        mix = [m.strip() for m in args.mixer.split(",") if m.strip()]
        d["mixer"] = mix[0] if len(mix) == 1 else mix
    return d


def main(args: argparse.Namespace) -> int:
    """`linattn train`: returns the exit code (0 done, 2 bad input, 128+N stopped by signal N)."""
    try:
        return _train_main(args)
    except USER_ERRORS as e:
        return _fail(e)


def _train_main(args) -> int:
    base = TrainConfig()
    if args.out is None:
        args.out = os.path.join("runs", "train")
    out = Path(args.out)
    saved_train: Dict[str, Any] = {}
    saved_model: Optional[Dict[str, Any]] = None
    if args.resume:
        ck = ckpt_mod.find_latest_checkpoint(out) if out.is_dir() else None
        if ck is not None:
            meta = ckpt_mod.read_checkpoint_config(ck)
            saved_train = meta.get("train", {}) or {}
            saved_model = meta.get("model")
        else:
            print(f"[linattn] no checkpoint in {out}; starting a new run", file=sys.stderr)
    vals = base.to_dict()
    for k in _TRAIN_FLAGS:
        if k in saved_train:
            vals[k] = saved_train[k]
    for k in _TRAIN_FLAGS:
        v = getattr(args, k, None)
        if v is not None:
            if saved_train and k in TRAJECTORY_FIELDS and k in saved_train and saved_train[k] != v:
                raise TrainError(f"config/checkpoint mismatch: --{k.replace('_', '-')} {v!r} but the "
                                 f"checkpoint was trained with {saved_train[k]!r}")
            vals[k] = v
    vals["out"] = str(out)
    for k in ("data", "tokenizer"):  # absolute, so that `eval` with no --data finds them from anywhere
        if getattr(args, k, None) is not None:
            vals[k] = os.path.abspath(getattr(args, k))
    vals["progress"] = False if args.no_progress else None
    cfg = TrainConfig.from_dict(vals)
    if saved_model is not None:
        explicit = _explicit_model_dict(args)
        check_resume_compatible(cfg, {}, explicit, saved_model)
        if args.mixer is not None:
            check_mixer(explicit["mixer"])
        model_config = ckpt_mod.model_config_from_dict(saved_model)
    else:
        if args.data is not None and not Path(args.data).exists():
            raise CorpusError(f"data path not found: {args.data}")
        model_config = _model_config_from_args(args, None, cfg.seq_len)
        if args.vocab_size is None and (args.preset or args.model_config):
            cfg.vocab_size = int(model_config.vocab_size)  # the preset's vocabulary, for the tokenizer
    res = train(cfg, model_config, resume=args.resume, overwrite=args.overwrite)
    summary = {"step": res.step, "loss": res.losses[-1][1] if res.losses else None, "val_loss": res.val_loss,
               "val_ppl": res.val_ppl, "tokens_per_s": res.tokens_per_s,
               "checkpoint": str(res.checkpoint) if res.checkpoint else None,
               "n_params": count_parameters(res.model)}
    if res.interrupted:
        print(f"[linattn] stopped at step {res.step}; checkpoint {res.checkpoint}; continue with --resume",
              file=sys.stderr)
        return 128 + int(res.signal) if res.signal else 0
    print(json.dumps(summary))
    return 0


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="run folder (its latest checkpoint) or a step folder")
    p.add_argument("--data", default=None, help="text file or folder, evaluated whole (default: the validation "
                                                "split of the checkpoint's training data)")
    p.add_argument("--seq-len", type=int, default=None, help="window length (default: the training seq_len)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-batches", type=int, default=None, help="evaluate at most this many batches")
    p.add_argument("--max-data-bytes", type=int, default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object")


def eval_main(args: argparse.Namespace) -> int:
    """`linattn eval`: perplexity of a checkpoint on --data (or its own validation split)."""
    try:
        if args.threads:
            torch.set_num_threads(args.threads)
        device = resolve_device(args.device)
        if args.data is not None and not Path(args.data).exists():
            raise CorpusError(f"data path not found: {args.data}")
        ck = ckpt_mod.load_checkpoint(args.checkpoint, device=device)
        if ck.tokenizer is None:
            raise CheckpointError(f"{ck.path} has no tokenizer.json")
        tc = ck.train_config
        seq_len = args.seq_len or int(tc.get("seq_len") or 256)
        if args.data is not None:
            docs = load_corpus(args.data, max_bytes=args.max_data_bytes)
            tokens = tokenize_documents(docs, ck.tokenizer)
            source = args.data
        else:
            cfg = TrainConfig.from_dict({**tc, "seq_len": seq_len, "tokenizer": None})
            docs = load_corpus(cfg.data, max_bytes=cfg.max_data_bytes)
            _, val_docs = split_documents(docs, cfg.val_fraction if cfg.val_fraction > 0 else 0.05)
            tokens = tokenize_documents(val_docs, ck.tokenizer)
            source = f"{cfg.data or 'stdlib'} (validation split)"
        data = PackedTokens(tokens, seq_len, name=str(source))
        res = evaluate(ck.model, data, batch_size=args.batch_size, max_batches=args.max_batches, device=device,
                       dtype=str(tc.get("dtype") or "float32"))
    except USER_ERRORS as e:
        return _fail(e)
    rec = {"checkpoint": str(ck.path), "step": ck.step, "data": str(source), **res.to_dict()}
    if args.json:
        print(json.dumps(rec))
    else:
        print(f"loss {res.loss:.4f}  perplexity {res.ppl:.3f}  tokens {res.tokens}  "
              f"({ck.path}, step {ck.step}, {source})")
    return 0
