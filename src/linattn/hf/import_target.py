"""Writing an imported model into a run folder (`import-hf --out`), for the linattn and the fla imports alike.

Nothing the folder held is lost before the new checkpoint is complete: under the run lock `train` uses (a second
import, or a training run, into the same folder is refused while one writes), the new checkpoint is written
beside the old ones and `latest` switched to it atomically (`checkpoint.save_checkpoint`); only then are the old
checkpoints and the previous run's metrics removed (`--overwrite`). A full disk or a kill during the write
leaves the folder as it was.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Union

from .. import checkpoint as ckpt
from ..errors import CheckpointError
from ..training.lock import RunLock
from ..training.run import METRICS_FILE

PathLike = Union[str, os.PathLike]


def check_out(source: PathLike, out: PathLike, overwrite: bool) -> None:
    """Refuse an `out` that is a file, the model folder itself, or a run holding a checkpoint without overwrite."""
    source, out = Path(source), Path(out)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"--out {out} is a file, not a run folder; pass a folder")
    if out.exists() and source.exists() and out.resolve() == source.resolve():
        raise CheckpointError(f"--out {out} is the model folder being imported; pass another folder")
    if not overwrite and out.is_dir() and (ckpt.has_checkpoint(out) or (out / METRICS_FILE).exists()):
        raise CheckpointError(f"{out} already holds a checkpoint or a run; pass --overwrite to replace it")


def write_import(source: PathLike, out: PathLike, overwrite: bool, write: Callable[[Path], Path]) -> Path:
    """Run `write(out)` (converting and saving one checkpoint, returning its step folder) under `out`'s run lock,
    then drop what `out` held before (with overwrite).

    Args:
        source: The model folder imported (for the checks).
        out: The run folder.
        overwrite: Replace the checkpoints and metrics `out` holds.
        write: Writes the checkpoint into `out` with `checkpoint.save_checkpoint(..., keep_last=None)`.

    Returns:
        The new step folder.

    Raises:
        CheckpointError: `check_out`'s refusals, or the conversion's and the write's errors (the folder is then
            as it was).
        RunFolderBusy: Another import or run holds `out`.
    """
    out = Path(out)
    check_out(source, out, overwrite)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        with RunLock(out, after_death="the checkpoints it holds are used as they are"):
            check_out(source, out, overwrite)  # again: another writer may have filled it before we held the lock
            ckpt.remove_stale_temps(out)
            old = ckpt.list_checkpoints(out)
            step_dir = write(out)
            for p in old:
                if p.name != step_dir.name:
                    ckpt.remove_checkpoint(p)
            (out / METRICS_FILE).unlink(missing_ok=True)
    except BaseException:
        if created:  # a failed import into a new folder leaves no folder behind
            try:
                out.rmdir()
            except OSError:
                pass
        raise
    return step_dir


__all__ = ["check_out", "write_import"]
