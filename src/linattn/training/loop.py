"""`train()`: a whole run around a `Trainer`: the run folder, data, resume, periodic logging,
validation and checkpoints, progress, and signals.

Exact resume: the batch of step s is a pure function of (seed, s) (`PackedTokens.get_batch`), and
a checkpoint holds the weights, the optimizer state, the step (the LR schedule is a function of
the step), the torch RNG states and the loss accumulator of the current logging interval
(`Trainer.state_dict`). So a resume after an interruption reproduces the uninterrupted run's
weights (bitwise on CPU). SIGINT/SIGTERM during training finish the current step, save, and
return (`interrupted=True`); a second SIGINT aborts at once (the last complete checkpoint stays
intact).

Several processes (`torchrun --nproc_per_node=N -m linattn train ...`, see `distributed`): every
rank reads the data and computes its share of each step's windows; validation is shared and
all-reduced; metrics.jsonl (every record with `world_size`), the progress bar and the checkpoint
files come from rank 0 only. After every step the ranks agree on a stop (a signal or should_stop
on any rank), so all of them stop after the same step and the checkpoint is written once.
Checkpoints are full (see `trainer`), so --resume works with another number of processes.

Only rank 0 touches the run folder: it holds the folder's lock for the whole run (`lock`), and when
one of its steps on the folder fails (the folder is busy, a save fails on a full disk), every rank
learns it (`_on_main`) and stops, instead of waiting for it. A non-finite loss or gradient stops the
run at that step (TrainingDiverged, naming the step and the last checkpoint) without updating the
weights, or with `skip_nonfinite` skips the batch (counted in the metrics and reported at the end);
weights that are not finite are never saved.
"""
from __future__ import annotations

import dataclasses
import errno
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .. import checkpoint as ckpt
from ..data.tokenizer import BPETokenizer, load_tokenizer
from ..errors import LinattnError
from ..logs import get_logger
from ..models.family import build_model, config_from_dict, config_to_dict
from .config import TrainConfig, TrainError, TrainingDiverged, check_resume_compatible
from .data import TrainData, prepare_data, rank_batch
from .distributed import Dist
from .init_from import init_setup
from .run import RunFolder, StopFlag
from .schedule import lr_at
from .trainer import EvalResult, StepOutput, Trainer

log = get_logger("training")


def step_line(rec: Dict[str, Any], steps: int) -> str:
    """The one line a logged step shows when there is no progress bar."""
    return (f"step {rec['step']}/{steps} loss {rec['loss']:.4f}"
            + (f" val_loss {rec['val_loss']:.4f}" if "val_loss" in rec else "")
            + f" lr {rec['lr']:.2e} tok/s {rec['tokens_per_s']:.0f}")


@dataclass
class TrainResult:
    """What `train` returns.

    Attributes:
        step: Steps completed.
        model: The trained model.
        model_config: Its config.
        tokenizer: The run's tokenizer.
        losses: (step, training loss) of every step run in this call.
        val_loss: The last validation loss (None: no validation).
        val_ppl: The last validation perplexity.
        tokens_per_s: Training tokens/s of this call (first step excluded).
        elapsed_s: The run's training time.
        checkpoint: The last checkpoint written (None: no run folder).
        interrupted: The run stopped on a signal or should_stop.
        signal: The signal that stopped it.
        resumed_from: The step a resumed run continued from.
        history: The metrics records written.
        skipped_steps: Batches skipped in this call (skip_nonfinite).
    """
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
    skipped_steps: List[int] = field(default_factory=list)        # batches skipped in this call (skip_nonfinite)


def train(config: TrainConfig, model_config=None, *, resume: bool = False, overwrite: bool = False,
          data: Optional[TrainData] = None, tokenizer: Optional[BPETokenizer] = None,
          model_factory: Optional[Callable[[Any], torch.nn.Module]] = None,
          should_stop: Optional[Callable[[int], bool]] = None, handle_signals: bool = True,
          on_log: Optional[Callable[[Dict[str, Any]], None]] = None) -> TrainResult:
    """Train a causal language model of any registered family.

    Checkpoints, the tokenizer and metrics.jsonl go to `config.out` (none: nothing is written). SIGINT / SIGTERM
    (handle_signals) and should_stop save a checkpoint and stop the run cleanly; `resume=True` continues it.

    Args:
        config: Everything about the run except the model architecture.
        model_config: a family config (`LMConfig`, `TLinFormerConfig`, ...) or its dict; its vocab_size
            is set to the tokenizer's. On resume it may be None (the checkpoint's is used).
        resume: continue from `config.out`'s latest checkpoint (a fresh start when there is none).
        overwrite: clear an occupied `config.out` (else it is refused with TrainError).
        data: prepared data (`prepare_data`), to share one tokenization across runs.
        tokenizer: The tokenizer to use (None: `config.tokenizer`, else one trained on the data).
        model_factory: model_factory(config) -> model: instead of the family's model class.
        should_stop: should_stop(step_done) -> bool: polled after every step, like a signal: save and stop.
        handle_signals: Install the SIGINT / SIGTERM handlers for the run.
        on_log: on_log(record): called with every metrics record.

    Returns:
        A `TrainResult`: the trained model, its config and tokenizer, the losses, the last validation and the
        checkpoint written.

    Raises:
        TrainError: A bad run folder (occupied without overwrite or resume), config or data.
        TrainingDiverged: A non-finite loss or gradient (unless `config.skip_nonfinite`).

    Examples:
        >>> from linattn import LMConfig
        >>> from linattn.training import TrainConfig, train
        >>> text = "the quick brown fox jumps over the lazy dog. " * 400
        >>> import pathlib
        >>> import tempfile
        >>> tmp = tempfile.TemporaryDirectory()
        >>> folder = pathlib.Path(tmp.name)
        >>> _ = (folder / "corpus.txt").write_text(text)
        >>> cfg = TrainConfig(data=str(folder / "corpus.txt"), vocab_size=300, seq_len=32, batch_size=4, steps=3,
        ...                   warmup=1, eval_batches=1, progress=False)
        >>> result = train(cfg, LMConfig(vocab_size=300, d_model=32, n_layers=1, n_heads=2, mixer="gated-deltanet"),
        ...                handle_signals=False)
        >>> result.step, len(result.losses)
        (3, 3)
        >>> tmp.cleanup()
    """
    config.validate()
    if config.threads:
        torch.set_num_threads(int(config.threads))
    if config.out is None and resume:
        raise TrainError("resume needs an output folder (config.out)")
    dist = Dist.from_env(config.device)
    folder = RunFolder(config.out) if config.out else None
    try:
        config.check_split(dist.world_size)
        if folder is not None:
            _on_main(dist, folder.lock_if_exists)
        resume_ck = folder.checkpoint_to_resume(resume, overwrite) if folder is not None else None
        if folder is not None:   # before any step: a scheduled save must not land on a folder it cannot replace
            start = ckpt.read_checkpoint_config(resume_ck).get("step", 0) if resume_ck is not None else 0
            folder.refuse_colliding_saves(start, config.steps, config.save_every, resume_ck)
        saved, model_config, tokenizer, init_ck = _model_setup(config, model_config, resume_ck, tokenizer, data)
        if data is None:
            # rank 0 prepares the data and writes its cache in the run folder; the other ranks then
            # read that cache (they write nothing there): one tokenization, one writer
            data = _on_main(dist, lambda: _load_data(config, tokenizer))
            if not dist.is_main:
                data = _load_data(config, tokenizer, verbose=False, write_cache=False)
        _check_data(config, data, saved)
        model_config = _with_vocab(model_config, data.tokenizer.vocab_size)
        trainer = _make_trainer(config, model_config, dist, resume_ck, model_factory, data.tokenizer.eos_id,
                                init_ck=init_ck)
        if init_ck is not None and dist.is_main and config.progress is not False:
            log.info(f"[linattn] weights and tokenizer from {init_ck}; a new run from step 0")
        # Everything that can fail on bad input has run: only now is the run folder touched.
        if folder is not None:
            _on_main(dist, lambda: folder.start(trainer.step if resume_ck is not None else None))
        dist.barrier()
        session = _Session(config, trainer, data, folder, model_config, resume_ck, handle_signals, should_stop,
                           on_log)
        return session.run()
    finally:
        if folder is not None:
            folder.close()
        dist.close()


def _model_setup(config: TrainConfig, model_config, resume_ck, tokenizer, data):
    """The model config and tokenizer a run starts with: the checkpoint's on resume, the `--init-from`
    checkpoint's for a new run from one, else the given ones. -> (the resumed checkpoint's config dict
    or {}, model config, tokenizer, the init-from checkpoint or None)."""
    if isinstance(model_config, dict):
        model_config = config_from_dict(model_config)
    saved: Dict[str, Any] = {}
    init_ck = None
    if resume_ck is not None:
        saved, model_config, tokenizer = _resume_setup(config, model_config, resume_ck, tokenizer, data)
    elif config.init_from is not None:   # (a resumed run already holds the weights it started from)
        init_ck, model_config, tokenizer = init_setup(config, model_config, tokenizer, data is not None)
    if model_config is None:
        raise TrainError("a model config is needed (none given and no checkpoint to resume)")
    return saved, model_config, tokenizer, init_ck


def _on_main(dist: Dist, fn: Callable[[], Any]) -> Any:
    """fn() on rank 0 only (None elsewhere). When it raises a LinattnError every rank learns it and raises
    too, so that no rank waits for one that is gone (rank 0 raises the error itself)."""
    result, error = None, None
    if dist.is_main:
        try:
            result = fn()
        except LinattnError as e:
            error = e
    failed = dist.max([float(error is not None)])[0] > 0 if dist.active else error is not None
    if error is not None:
        raise error
    if failed:
        raise TrainError("rank 0 stopped the run (it reports why)")
    return result


def _resume_setup(cfg: TrainConfig, model_config, resume_ck: Path, tokenizer, data):
    """(saved config.json, model config, tokenizer) of the checkpoint to resume, checked against cfg."""
    saved = ckpt.read_checkpoint_config(resume_ck)
    check_resume_compatible(cfg, saved.get("train", {}),
                            config_to_dict(model_config) if model_config is not None else None, saved.get("model"))
    if tokenizer is None and data is None:
        tokenizer = load_tokenizer(resume_ck)
    if model_config is None:
        model_config = ckpt.model_config_from_dict(saved["model"])
    return saved, model_config, tokenizer


def _load_data(cfg: TrainConfig, tokenizer: Optional[BPETokenizer], verbose: bool = True,
               write_cache: bool = True) -> TrainData:
    t = time.perf_counter()
    data = prepare_data(cfg, tokenizer, write_cache=write_cache)
    if cfg.progress is not False and verbose:
        log.info(f"[linattn] data {data.source}: {data.train.n_tokens:,} training tokens"
                 + (f", {data.val.n_tokens:,} validation tokens" if data.val is not None else "")
                 + f", vocab {data.tokenizer.vocab_size} ({time.perf_counter() - t:.1f} s)")
    return data


def _check_data(cfg: TrainConfig, data: TrainData, saved: Dict[str, Any]) -> None:
    """The data fits the config, and on resume it is the checkpoint's (tokens and vocabulary)."""
    if data.train.seq_len != cfg.seq_len:
        raise TrainError(f"data packed for seq_len {data.train.seq_len}, config says {cfg.seq_len}")
    saved_fp = saved.get("data_fingerprint")
    if saved_fp and saved_fp != data.fingerprint:
        raise TrainError(f"config/checkpoint mismatch: the data (or tokenizer) differs from the run's "
                         f"({data.fingerprint} vs {saved_fp}); pass the same --data")
    saved_vocab = (saved.get("model") or {}).get("vocab_size")
    if saved_vocab is not None and saved_vocab != data.tokenizer.vocab_size:
        raise TrainError(f"config/checkpoint mismatch: the checkpoint's model has vocab_size {saved_vocab}, "
                         f"the tokenizer {data.tokenizer.vocab_size}")


def _with_vocab(model_config, vocab_size: int):
    """The model config with the tokenizer's vocab_size."""
    if model_config.vocab_size == vocab_size:
        return model_config
    return dataclasses.replace(model_config, vocab_size=vocab_size)


def _make_trainer(cfg: TrainConfig, model_config, dist: Dist, resume_ck: Optional[Path],
                  model_factory, eos_id: Optional[int] = None, init_ck: Optional[Path] = None) -> Trainer:
    """Build the model (seeded) and its Trainer; on resume load the weights (before DDP / FSDP wrap
    the model) and the training state; with init_ck (--init-from) only that checkpoint's weights."""
    torch.manual_seed(cfg.seed)
    try:
        model = (model_factory or build_model)(model_config)
    except (TypeError, ValueError, KeyError) as e:
        raise TrainError(f"cannot build the model: {e}") from None
    if resume_ck is not None or init_ck is not None:
        ckpt.load_model_weights(model, resume_ck or init_ck, device="cpu", model_config=config_to_dict(model_config))
    trainer = Trainer(model, cfg, dist=dist, eos_id=eos_id)
    if resume_ck is not None:
        try:
            trainer.load_state_dict(ckpt.load_training_state(resume_ck))
        except ckpt.CheckpointError as e:
            raise ckpt.CheckpointError(f"{resume_ck}: {e}") from None
    return trainer


class _Session:
    """The step loop of one `train()` call, with its logging, validation, checkpoints and stop rules."""

    def __init__(self, cfg: TrainConfig, trainer: Trainer, data: TrainData, folder: Optional[RunFolder],
                 model_config, resume_ck: Optional[Path], handle_signals: bool,
                 should_stop: Optional[Callable[[int], bool]], on_log):
        self.cfg, self.trainer, self.data, self.folder = cfg, trainer, data, folder
        self.model_config, self.resume_ck = model_config, resume_ck
        self.should_stop, self.on_log = should_stop, on_log
        self.stop = StopFlag(handle_signals)
        self.start = trainer.step
        self.losses: List[Tuple[int, float]] = []
        self.step_times: List[float] = []
        self.history: List[Dict[str, Any]] = []
        self.skipped_steps: List[int] = []
        self.last_ckpt: Optional[Path] = resume_ck
        self.val: Optional[EvalResult] = None
        self.dist = trainer.dist
        self.main = self.dist.is_main
        self.echo = self.main and cfg.progress is None and not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty())
        self.bar = None

    def run(self) -> TrainResult:
        from tqdm.auto import tqdm

        cfg, trainer = self.cfg, self.trainer
        self._announce()
        show = (None if cfg.progress is None else not cfg.progress) if self.main else True
        self.bar = tqdm(total=cfg.steps, initial=min(self.start, cfg.steps), desc="train", unit="step",
                        dynamic_ncols=True, disable=show, leave=True)
        interrupted = False
        t_start = time.perf_counter()
        trainer.start_clock()
        self.t_int, self.tok_int = time.perf_counter(), 0
        try:
            with self.stop:
                while trainer.step < cfg.steps and not interrupted:
                    interrupted = self._one_step()
        except TrainingDiverged as e:
            raise TrainingDiverged(f"{e}; {self._kept()}") from None
        finally:
            self.bar.close()
        self._report_skipped()
        return self._result(interrupted, time.perf_counter() - t_start)

    def _kept(self) -> str:
        """What a stopped run leaves to go on from."""
        if self.folder is None:
            return "nothing was saved"
        if self.last_ckpt is None:
            return f"no checkpoint was written in {self.folder.path} (rerun with --overwrite)"
        return f"the last checkpoint, {self.last_ckpt}, is intact (nothing was saved after it)"

    def _report_skipped(self) -> None:
        if self.skipped_steps and self.main:
            steps = ", ".join(map(str, self.skipped_steps[:20])) + (", ..." if len(self.skipped_steps) > 20 else "")
            n, ran = len(self.skipped_steps), self.trainer.step - self.start
            log.warning(f"[linattn] skipped {n} of {ran} steps (a non-finite loss or gradient; --skip-nonfinite): "
                        f"steps {steps}")

    def _announce(self) -> None:
        if self.cfg.progress is not False and self.main:
            d = self.dist
            procs = (f" x {d.world_size} processes ({self.cfg.parallel}, {d.backend})" if d.active else "")
            log.info(f"[linattn] model: {self.trainer.model.num_parameters():,} parameters on {self.trainer.device}"
                     f"{procs}; " + (f"resuming at step {self.start}" if self.resume_ck is not None else "new run")
                     + (f" in {self.folder.path}" if self.folder is not None else ""))

    def _one_step(self) -> bool:
        """Train one step, then log / validate / save as due; True when a stop was requested."""
        cfg = self.cfg
        t0 = time.perf_counter()
        x, y = rank_batch(self.data.train, self.trainer.step, cfg.batch_size, cfg.seed, self.dist.rank,
                          self.dist.world_size)
        out = self.trainer.train_step(x, y)
        self.step_times.append(time.perf_counter() - t0)
        if out.skipped is not None:
            self._note_skipped(out)
        else:
            self.losses.append((out.step, out.loss))
        self.tok_int += cfg.batch_size * cfg.seq_len
        self.bar.update(1)
        last = out.step == cfg.steps
        do_eval = (cfg.eval_every > 0 and out.step % cfg.eval_every == 0) or last
        if out.step % cfg.log_every == 0 or do_eval:
            self._log(out, do_eval)
        stopping = self._stop_requested(out.step)
        if (cfg.save_every > 0 and out.step % cfg.save_every == 0) or last or stopping:
            self.last_ckpt = self._save() or self.last_ckpt
            self.t_int = time.perf_counter()  # saving is not training time
        return stopping and not last

    def _note_skipped(self, out: StepOutput) -> None:
        self.skipped_steps.append(out.step)
        if self.main:
            log.warning(f"[linattn] warning: step {out.step}: {out.skipped}; batch skipped (--skip-nonfinite), "
                        f"{self.trainer.skipped} so far")

    def _stop_requested(self, step: int) -> bool:
        """A signal or should_stop on any rank: every rank gets the same answer (and the signal)."""
        local_sig = float(self.stop.signum or 0)
        local_stop = float(self.should_stop is not None and bool(self.should_stop(step)))
        if not self.dist.active:
            return local_sig > 0 or local_stop > 0
        sig, stop = self.dist.max([local_sig, local_stop])
        if sig > 0 and self.stop.signum is None:
            self.stop.signum = int(sig)   # another rank's signal: this rank reports it too
        return sig > 0 or stop > 0

    def _log(self, out: StepOutput, do_eval: bool) -> None:
        now = time.perf_counter()
        loss = self.trainer.interval_loss() if self.trainer.loss_count else float("nan")   # NaN: all skipped
        rec: Dict[str, Any] = {"step": out.step, "loss": loss, "last_loss": out.loss,
                               "lr": out.lr, "tokens": self.trainer.tokens_seen,
                               "tokens_per_s": self.tok_int / max(1e-9, now - self.t_int),
                               "elapsed_s": self.trainer.elapsed_s(), "world_size": self.dist.world_size}
        if out.grad_norm is not None:
            rec["grad_norm"] = out.grad_norm
        if out.aux_loss is not None:
            rec["aux_loss"] = out.aux_loss
        if self.trainer.skipped:
            rec["skipped"] = self.trainer.skipped
        if do_eval:
            self.val = self._validate()
            if self.val is not None:
                rec["val_loss"], rec["val_ppl"] = self.val.loss, self.val.ppl
        self.history.append(rec)
        if self.main:
            if self.folder is not None:
                self.folder.append_metrics(rec)
            if self.on_log is not None:
                self.on_log(rec)
            self._show(rec)
        self.t_int, self.tok_int = time.perf_counter(), 0

    def _show(self, rec: Dict[str, Any]) -> None:
        if self.echo:  # no progress bar (not a terminal): one line per logged step
            log.info(step_line(rec, self.cfg.steps))
        self.bar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}",
                             **({"val": f"{rec['val_loss']:.3f}"} if "val_loss" in rec else {}))

    def _validate(self) -> Optional[EvalResult]:
        return self.trainer.evaluate(self.data.val) if self.data.val is not None else None

    def _save(self) -> Optional[Path]:
        """Write a checkpoint from rank 0 (under FSDP every rank helps gather the full state)."""
        if self.folder is None:
            return None
        t = self.trainer
        weights, state = t.model_state_dict(), t.state_dict()
        path = _on_main(self.dist, lambda: self._write_checkpoint(weights, state))
        self.dist.barrier()
        return path or self.folder.path / ckpt.step_dir_name(t.step)

    def _write_checkpoint(self, weights: Dict[str, torch.Tensor], state: Dict[str, Any]) -> Path:
        t = self.trainer
        bad = ckpt.nonfinite_tensors(weights)
        if bad:
            raise TrainingDiverged(f"training diverged at step {t.step}: its update made the weights non-finite "
                                   f"(NaN or inf in {bad[0]}; lr {lr_at(t.step - 1, self.cfg):.3g}); not saved; "
                                   f"try a lower --lr")
        try:
            return ckpt.save_checkpoint(self.folder.path, t.step, None, state_dict=weights,
                                        model_config=config_to_dict(self.model_config),
                                        tokenizer=self.data.tokenizer, train_config=self.cfg.to_dict(),
                                        training_state=state,
                                        extra={"data_fingerprint": self.data.fingerprint,
                                               "data_source": self.data.source,
                                               "n_params": t.model.num_parameters(),
                                               "world_size": self.dist.world_size},
                                        keep_last=self.cfg.keep_last)
        except ckpt.CheckpointWriteError as e:
            hint = self._room_hint() if e.errno == errno.ENOSPC else ""
            if not hint:
                raise
            err = ckpt.CheckpointWriteError(f"{e}{hint}")
            err.errno, err.strerror, err.filename = e.errno, e.strerror, e.filename
            raise err from None

    def _room_hint(self) -> str:
        """How a run that filled its disk can go on: the older checkpoints a resume with a lower
        TrainConfig.keep_last removes before its next save (the newest one always stays)."""
        older = ckpt.list_checkpoints(self.folder.path)[:-1]
        if not older:
            return ""
        size = sum(f.stat().st_size for d in older for f in d.iterdir() if f.is_file())
        names = ", ".join(d.name for d in older[:3]) + (f" and {len(older) - 3} more" if len(older) > 3 else "")
        return (f"; to make room, --resume with TrainConfig.keep_last 1 removes the {len(older)} older "
                f"checkpoint{'s' if len(older) > 1 else ''} ({names}, {size / 2**20:.1f} MiB) before its next save")

    def _result(self, interrupted: bool, elapsed: float) -> TrainResult:
        timed = self.step_times[1:] if len(self.step_times) > 1 else self.step_times
        tokens_per_step = self.cfg.batch_size * self.cfg.seq_len
        tps = tokens_per_step * len(timed) / sum(timed) if timed and sum(timed) > 0 else None
        if self.val is None and not interrupted and self.data.val is not None and self.start >= self.cfg.steps:
            self.val = self._validate()
        return TrainResult(step=self.trainer.step, model=self.trainer.model, model_config=self.model_config,
                           tokenizer=self.data.tokenizer, losses=self.losses,
                           val_loss=self.val.loss if self.val else None, val_ppl=self.val.ppl if self.val else None,
                           tokens_per_s=tps, elapsed_s=elapsed, checkpoint=self.last_ckpt, interrupted=interrupted,
                           signal=self.stop.signum, resumed_from=self.start if self.resume_ck is not None else None,
                           history=self.history, skipped_steps=self.skipped_steps)


__all__ = ["TrainResult", "train"]
