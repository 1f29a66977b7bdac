"""The run folder (checkpoints, `metrics.jsonl`) and the SIGINT/SIGTERM stop flag.

A run folder is refused when it holds a previous run, unless the caller resumes it or overwrites
it; nothing in it is touched before everything that can fail on bad input has run (`RunFolder.begin`
is the first write). `metrics.jsonl` gets one JSON record per line, appended as training goes; on a
resume the records after the checkpoint's step are dropped (atomically), so the file always
matches the weights.

One writer at a time: the run holds the folder's lock (`lock.RunLock`) from its start (or, for a
folder that does not exist yet, from its first write) to its end. Starting over removes only what
linattn wrote (its own checkpoints, `latest`, `metrics.jsonl`) and warns once about other `step_*`
folders; a run that starts removes the temporary files of writers that died mid-write.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from .. import checkpoint as ckpt
from ..io import append_jsonl, read_jsonl, write_jsonl
from ..logs import get_logger
from ..signals import StopFlag  # re-exported: the trainer's stop flag is the one of linattn.signals
from .config import TrainError
from .lock import RunLock

log = get_logger("training")

METRICS_FILE = "metrics.jsonl"


def read_metrics(run_dir_or_file: Union[str, os.PathLike]) -> List[Dict[str, Any]]:
    """The records of a run's metrics.jsonl (a torn last line, from a kill mid-write, is dropped).

    Args:
        run_dir_or_file: The run folder, or its metrics.jsonl.

    Returns:
        One dict per record, in order.
    """
    p = Path(run_dir_or_file)
    return read_jsonl(p / METRICS_FILE if p.is_dir() else p)


class RunFolder:
    """The output folder of a run: its lock, its checkpoints (`linattn.checkpoint`) and metrics.jsonl."""

    def __init__(self, path: Union[str, os.PathLike]):
        self.path = Path(path)
        self.metrics_path = self.path / METRICS_FILE
        self.lock = RunLock(self.path, after_death=self._after_death)
        self._plan: Optional[tuple] = None   # (resume, overwrite, checkpoint) as checkpoint_to_resume found them

    def _after_death(self) -> str:
        """What a run that died left to go on from (the lock's warning), true whether this run resumes or not."""
        try:
            ck = ckpt.find_latest_checkpoint(self.path)
        except ckpt.CheckpointError:
            ck = None
        return (f"its last complete checkpoint, {ck.name}, is intact" if ck is not None
                else "it left no complete checkpoint")

    def refuse_colliding_saves(self, start: int, steps: int, save_every: int, resume_ck: Optional[Path]) -> None:
        """Refuse, before any step, a run whose scheduled saves (every `save_every` steps after `start`, and
        the last step) would land on a step folder that is not a complete checkpoint: it would be refused
        there, after the steps since the last save were trained for nothing."""
        for p, why in ckpt.damaged_step_dirs(self.path):
            n = ckpt.step_of(p)
            if start < n <= steps and (n == steps or (save_every > 0 and n % save_every == 0)):
                then = (f"; --resume then continues from {resume_ck.name}" if resume_ck is not None else "")
                raise TrainError(f"{p} is not a readable checkpoint ({why}), and this run would save step {n} "
                                 f"there; move it away or remove it{then}")

    def lock_if_exists(self) -> None:
        """Take the folder's lock now if the folder exists (else `begin` takes it when it creates it)."""
        if self.path.is_dir():
            self.lock.acquire()

    def checkpoint_to_resume(self, resume: bool, overwrite: bool) -> Optional[Path]:
        """Refuse an occupied folder unless resume/overwrite; return the checkpoint to resume (if any)."""
        out = self.path
        if out.exists() and not out.is_dir():
            raise TrainError(f"--out {out} exists and is not a folder")
        try:
            latest = ckpt.find_latest_checkpoint(out) if out.is_dir() else None
        except ckpt.DanglingLatest:
            if resume:
                raise
            latest = None
        pointer = (out / ckpt.LATEST_FILE).exists()
        self._plan = (resume, overwrite, latest)
        if resume:
            return latest
        if (latest is not None or pointer or self.metrics_path.exists()) and not overwrite:
            what = (f"a checkpoint (step {ckpt.read_checkpoint_config(latest).get('step')})" if latest
                    else "a previous run")
            raise TrainError(f"{out} already holds {what}; pass --resume to continue it or --overwrite to start over")
        return None

    def start(self, resume_step: Optional[int]) -> None:
        """`begin` under the folder's lock: taken here unless `lock_if_exists` took it (the folder did not
        exist then), in which case the folder is checked again (another run may have filled it since)."""
        self.path.mkdir(parents=True, exist_ok=True)
        if not self.lock.held:
            self.lock.acquire()
            if self._plan is not None and self.checkpoint_to_resume(*self._plan[:2]) != self._plan[2]:
                raise TrainError(f"{self.path} changed while this run was starting (another run wrote to it); "
                                 f"start again")
        self.begin(resume_step)

    def begin(self, resume_step: Optional[int]) -> None:
        """Create the folder and remove dead writers' temporary files; a new run clears the previous one,
        a resume cuts the metrics at its step."""
        self.path.mkdir(parents=True, exist_ok=True)
        ckpt.remove_stale_temps(self.path)
        if resume_step is None:
            self.clear()
            self.metrics_path.touch()
        else:
            kept = [r for r in read_metrics(self.metrics_path) if int(r.get("step", 0)) <= resume_step]
            write_jsonl(self.metrics_path, kept)

    def clear(self) -> None:
        """Remove the previous run's checkpoints, `latest` pointer and metrics: only what linattn wrote.
        Other `step_*` folders stay, with one warning."""
        foreign = [p.name for p in sorted(self.path.glob(ckpt.STEP_PREFIX + "*"))
                   if p.is_dir() and not ckpt.remove_checkpoint(p)]
        if foreign:
            log.warning(f"[linattn] warning: {self.path} holds folders that are not linattn checkpoints, left as "
                        f"they are: {', '.join(foreign)}")
        for name in (ckpt.LATEST_FILE, METRICS_FILE):
            if (self.path / name).is_file():
                (self.path / name).unlink()

    def close(self) -> None:
        """Release the folder's lock (if this process holds it)."""
        self.lock.release()

    def append_metrics(self, record: Dict[str, Any]) -> None:
        try:
            append_jsonl(self.metrics_path, record)
        except OSError as e:
            raise TrainError(f"cannot append to {self.metrics_path}: {e.strerror or e}") from None

    def metrics(self) -> List[Dict[str, Any]]:
        return read_metrics(self.metrics_path)


__all__ = ["METRICS_FILE", "read_metrics", "RunFolder", "StopFlag"]
