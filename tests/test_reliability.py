"""Reliability of training runs and checkpoints (issues 18.1, 18.4, 19.4, 19.6, 19.7, 19.9): one writer
per run folder, kill -9 / full disk / NaN during training, foreign folders left alone, corrupt checkpoints
as one-line errors, the architecture recorded with the weights, and the small leftovers of a crash."""
import errno
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from linattn import checkpoint as ckpt
from linattn.cli import main
from linattn.training import TrainConfig, TrainError, read_metrics, train
from tests.helpers import copy_run, dead_pid, error_line, short_train_argv as argv, tiny_model

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_thread")


def weights(path):
    return ckpt.load_checkpoint(path).model.state_dict()


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus):
    """A finished 4-step efla run (checkpoints at steps 2 and 4)."""
    out = tmp_path_factory.mktemp("trained") / "run"
    assert main(argv(corpus, out)) == 0
    return out


# ----------------------------------------------------------------------------- 1. one writer per run folder

def test_second_writer_is_refused_naming_the_holder(trained, corpus, tmp_path, capsys):
    from linattn.training.lock import RunLock

    out = copy_run(trained, tmp_path / "run")
    holder = RunLock(out)
    holder.acquire()
    try:
        capsys.readouterr()
        before = read_metrics(out)
        assert main(argv(corpus, out, "--resume", "--steps", "6")) == 2
        line = error_line(capsys)
        assert str(out) in line and f"pid {os.getpid()}" in line
        assert read_metrics(out) == before                          # the second writer wrote nothing
    finally:
        holder.release()
    assert main(argv(corpus, out, "--resume", "--steps", "6")) == 0   # free again: it runs
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4, 5, 6]


def test_lock_left_by_a_dead_process_is_reported_and_taken(trained, corpus, tmp_path, capsys):
    from linattn.training.lock import LOCK_FILE

    out = copy_run(trained, tmp_path / "run")
    pid = dead_pid()
    (out / LOCK_FILE).write_text(json.dumps({"pid": pid, "host": socket.gethostname()}))
    capsys.readouterr()
    assert main(argv(corpus, out, "--resume", "--steps", "5")) == 0
    warn = [ln for ln in capsys.readouterr().err.splitlines() if "warning" in ln and str(pid) in ln]
    assert len(warn) == 1 and "died" in warn[0], warn
    assert not (out / LOCK_FILE).exists()                              # released at the end


def test_only_rank_0_writes_to_the_run_folder(corpus, tmp_path, monkeypatch):
    from linattn.training import loop
    from linattn.training.distributed import Dist

    class Rank1(Dist):   # rank 1 of 2, with collectives that stay local (no process group in a test)
        @property
        def active(self):
            return False

    monkeypatch.setattr(loop.Dist, "from_env", classmethod(lambda cls, device=None: Rank1(rank=1, world_size=2)))
    opened = []
    real_open = open

    def spy_open(file, *a, **k):
        opened.append(str(file))
        return real_open(file, *a, **k)

    monkeypatch.setattr("builtins.open", spy_open)
    out = tmp_path / "run"
    cfg = TrainConfig(data=str(corpus), out=str(out), vocab_size=300, seq_len=32, batch_size=4, steps=3,
                      save_every=1, eval_every=0, eval_batches=1, log_every=1, progress=False)
    res = train(cfg, tiny_model(), handle_signals=False)
    assert res.step == 3
    from linattn.training.lock import LOCK_FILE

    for name in ("metrics.jsonl", "latest", LOCK_FILE):                # no lock, no metrics, no checkpoint
        assert not (out / name).exists()
    assert not list(out.glob("step_*")) and not list(out.glob(".tmp*"))
    assert not [f for f in opened if str(out) in f] and not (out / "data_cache").exists()   # rank 0 writes it


# ----------------------------------------------------------------------------- 2. faults during training

CHILD = """
import os, sys, time
import linattn.checkpoint as ckpt
real_save = ckpt.torch.save

def save_then_hang(obj, f, *a, **k):  # step 4's checkpoint: training state written, config.json not yet
    real_save(obj, f, *a, **k)
    if isinstance(obj, dict) and obj.get("step") == 4:
        open(sys.argv[1], "w").write(str(os.getpid()))
        time.sleep(600)

ckpt.torch.save = save_then_hang
from linattn.cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_kill_9_mid_save_then_exact_resume(corpus, tmp_path, capsys):
    out, mark = tmp_path / "run", tmp_path / "hanging"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(mark), *argv(corpus, out)], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600   # generous: only a hung child uses it up (loaded machines)
        while not mark.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mark.exists(), child.communicate(timeout=10)[1] if child.poll() is not None else "no save"
        # the run is alive, holding its folder: a second writer is refused and names it
        capsys.readouterr()
        assert main(argv(corpus, out, "--resume")) == 2
        assert f"pid {child.pid}" in error_line(capsys)
        child.kill()                                                   # SIGKILL in the middle of the save
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert ckpt.find_latest_checkpoint(out) == out / "step_00000002"  # the last good checkpoint
    ck = ckpt.load_checkpoint(out, with_training_state=True)
    assert ck.step == 2 and ck.training_state["step"] == 2
    assert list(out.glob(".tmp_step_00000004.*"))                      # the half-written one, never visible
    assert main(argv(corpus, out, "--resume")) == 0
    err = capsys.readouterr().err
    assert f"pid {child.pid}" in err and "died" in err                 # the dead holder is reported
    assert not list(out.glob(".tmp*"))
    ref = tmp_path / "ref"
    assert main(argv(corpus, ref)) == 0
    a, b = weights(out), weights(ref)
    assert all(torch.equal(a[k], b[k]) for k in b)                     # exact resume
    assert read_metrics(out) and [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]


def test_full_disk_fails_the_save_and_keeps_the_previous_checkpoint(corpus, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    real_save = ckpt.torch.save

    def full_disk(obj, f, *a, **k):
        if isinstance(obj, dict) and obj.get("step") == 4:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(ckpt.torch, "save", full_disk)
    capsys.readouterr()
    assert main(argv(corpus, out)) == 2
    line = error_line(capsys)
    assert "step_00000004" in line and os.strerror(errno.ENOSPC) in line and "step_00000002" in line
    monkeypatch.undo()
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step_00000002"]
    assert (out / "latest").read_text().strip() == "step_00000002"
    assert not list(out.glob(".tmp*"))
    assert ckpt.load_checkpoint(out, with_training_state=True).step == 2
    assert main(argv(corpus, out, "--resume")) == 0                    # disk freed: the run goes on


def _poison_steps(monkeypatch, steps):
    """Make the training forward of the given steps (1-based) return NaN logits."""
    from linattn.training import trainer as trainer_mod

    real = trainer_mod.forward_logits
    calls = {"n": 0}

    def poisoned(model, x, eos_id=None):
        logits, aux = real(model, x, eos_id)
        if torch.is_grad_enabled():
            calls["n"] += 1
            if calls["n"] in steps:
                logits = logits * float("nan")
        return logits, aux

    monkeypatch.setattr(trainer_mod, "forward_logits", poisoned)


def test_nan_loss_stops_naming_the_step_and_saves_nothing_after(corpus, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    _poison_steps(monkeypatch, {3})
    capsys.readouterr()
    assert main(argv(corpus, out, "--save-every", "1")) == 2
    line = error_line(capsys)
    assert "step 3" in line and "nan" in line.lower() and "step_00000002" in line
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step_00000001", "step_00000002"]


def test_skip_nonfinite_skips_counts_and_reports(corpus, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    _poison_steps(monkeypatch, {2, 3})
    capsys.readouterr()
    assert main(argv(corpus, out, "--skip-nonfinite", "true")) == 0
    cap = capsys.readouterr()
    assert "skipped 2" in cap.err and json.loads(cap.out.strip().splitlines()[-1])["skipped_steps"] == 2
    recs = read_metrics(out)
    assert [r["step"] for r in recs] == [1, 2, 3, 4] and recs[-1]["skipped"] == 2
    assert all(math.isfinite(r["loss"]) for r in recs if r["step"] not in (2, 3))
    assert all(torch.isfinite(v).all() for v in weights(out).values())
    assert ckpt.load_checkpoint(out / "step_00000004", with_training_state=True).training_state["skipped"] == 2


# ----------------------------------------------------------------------------- 3. foreign folders

def test_a_new_run_never_deletes_folders_it_did_not_write(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    (out / "step_mine").mkdir(parents=True)
    (out / "step_mine" / "notes.txt").write_text("mine")
    (out / "step_00000002").mkdir()
    (out / "step_00000002" / "data.bin").write_bytes(b"\x01\x02")
    capsys.readouterr()
    assert main(argv(corpus, out, "--save-every", "0")) == 0           # a new run, no --overwrite
    err = capsys.readouterr().err
    assert (out / "step_mine" / "notes.txt").read_text() == "mine"
    assert (out / "step_00000002" / "data.bin").read_bytes() == b"\x01\x02"
    warn = [ln for ln in err.splitlines() if "step_mine" in ln]
    assert len(warn) == 1 and "step_00000002" in warn[0]               # one warning, naming both
    assert main(argv(corpus, out, "--overwrite", "--steps", "1")) == 0
    assert (out / "step_mine" / "notes.txt").exists() and (out / "step_00000002" / "data.bin").exists()
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step_00000001"]   # ours: replaced
    assert not (out / "step_00000004").exists()
    capsys.readouterr()
    assert main(argv(corpus, out, "--overwrite", "--steps", "2")) == 2          # a save would replace it: refused
    assert "step_00000002" in error_line(capsys) and (out / "step_00000002" / "data.bin").exists()


# ----------------------------------------------------------------------------- 4. divergence, bad checkpoints

def test_huge_lr_stops_naming_the_step_and_leaves_a_rerunnable_folder(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    capsys.readouterr()
    assert main(argv(corpus, out, "--lr", "1e9", "--warmup", "0", "--save-every", "1", "--steps", "6")) == 2
    line = error_line(capsys)
    assert "step 2" in line and "lr" in line
    for p in ckpt.list_checkpoints(out):                               # nothing non-finite was saved
        assert all(torch.isfinite(v).all() for v in weights(p).values())
    assert not list(out.glob(".tmp*")) and not list(out.glob(".*lock*"))
    assert main(argv(corpus, out, "--overwrite", "--steps", "2")) == 0


def test_an_update_that_corrupts_the_weights_is_never_saved(corpus, tmp_path, capsys, monkeypatch):
    real_step = torch.optim.AdamW.step

    def corrupting_step(self, *a, **k):   # the update of step 1 turns a weight into inf (as lr = inf would)
        out = real_step(self, *a, **k)
        with torch.no_grad():
            self.param_groups[0]["params"][0].view(-1)[0] = float("inf")
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", corrupting_step)
    out = tmp_path / "run"
    capsys.readouterr()
    assert main(argv(corpus, out, "--save-every", "1")) == 2
    line = error_line(capsys)
    assert "step 1" in line and "not finite" in line.replace("non-finite", "not finite")
    assert not ckpt.list_checkpoints(out) and not (out / "latest").exists() and not list(out.glob(".tmp*"))
    monkeypatch.undo()
    assert main(argv(corpus, out, "--overwrite", "--steps", "2")) == 0    # nothing blocks a rerun


def test_infinite_lr_never_saves_non_finite_weights(corpus, tmp_path):
    out = tmp_path / "run"
    cfg = TrainConfig(data=str(corpus), out=str(out), vocab_size=300, seq_len=32, batch_size=4, steps=3, warmup=0,
                      lr=float("inf"), save_every=1, eval_every=0, eval_batches=1, log_every=1, progress=False)
    with pytest.raises(TrainError) as e:
        train(cfg, tiny_model(), handle_signals=False)
    msg = str(e.value)
    assert "lr" in msg and ("step 1" in msg or "finite" in msg) and len(msg.splitlines()) == 1
    assert not ckpt.list_checkpoints(out) and not list(out.glob(".tmp*"))


def _edit_config(folder, edit):
    p = folder / "step_00000004" / "config.json"
    meta = json.loads(p.read_text())
    edit(meta)
    p.write_text(json.dumps(meta))


BAD_CONFIGS = {
    "step": lambda m: m.update(step="abc"),
    "train": lambda m: m.update(train="xyz"),
    "seq_len": lambda m: m["train"].update(seq_len="abc"),
    "model": lambda m: m.update(model="xyz"),
}


@pytest.mark.parametrize("what", sorted(BAD_CONFIGS))
def test_bad_checkpoint_config_is_a_one_line_error(trained, corpus, tmp_path, capsys, what):
    out = copy_run(trained, tmp_path / "run")
    _edit_config(out, BAD_CONFIGS[what])
    with pytest.raises(ckpt.CheckpointError, match="config.json") as e:
        ckpt.load_checkpoint(out)
    assert what in str(e.value) and len(str(e.value).splitlines()) == 1
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(out), "--data", str(corpus), "--max-batches", "1"]) == 2
    assert "config.json" in error_line(capsys)
    assert main(["generate", "--checkpoint", str(out), "--max-new-tokens", "2"]) == 2
    assert "config.json" in error_line(capsys)
    assert main(argv(corpus, out, "--resume", "--steps", "6")) == 2
    assert "config.json" in error_line(capsys)


def test_nan_weights_in_a_checkpoint_are_a_one_line_error(trained, corpus, tmp_path, capsys):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    out = copy_run(trained, tmp_path / "run")
    f = out / "step_00000004" / "model.safetensors"
    with safe_open(str(f), "pt") as h:
        meta = h.metadata()
    tensors = load_file(str(f))
    name = sorted(tensors)[0]
    tensors[name][0] = float("nan")
    save_file(tensors, str(f), metadata=meta)
    with pytest.raises(ckpt.CheckpointError, match="not finite") as e:
        ckpt.load_checkpoint(out)
    assert name in str(e.value)
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(out), "--data", str(corpus), "--max-batches", "1"]) == 2
    assert "not finite" in error_line(capsys)
    assert main(argv(corpus, out, "--resume", "--steps", "6")) == 2
    assert "not finite" in error_line(capsys)


# ----------------------------------------------------------------------------- 5. the architecture

def _save_lm(run, mixer, **kw):
    cfg = tiny_model(vocab=64, mixer=mixer, **kw)
    from linattn.models.family import build_model, config_to_dict

    torch.manual_seed(0)
    return ckpt.save_checkpoint(run, 1, build_model(cfg), model_config=config_to_dict(cfg))


def test_weights_of_another_architecture_are_refused(tmp_path, capsys):
    efla = _save_lm(tmp_path / "efla", "efla")
    delta = _save_lm(tmp_path / "delta", "deltanet")
    shutil.copy(delta / "model.safetensors", efla / "model.safetensors")   # same names and shapes
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.load_checkpoint(efla)
    msg = str(e.value)
    assert "deltanet" in msg and "efla" in msg and len(msg.splitlines()) == 1
    assert main(["generate", "--checkpoint", str(tmp_path / "efla"), "--max-new-tokens", "1"]) == 2
    assert "deltanet" in error_line(capsys)
    # a field that changes the meaning but not the shapes: RoPE
    _save_lm(tmp_path / "rope", "efla", rope=True)
    shutil.copy(tmp_path / "rope" / "step_00000001" / "model.safetensors", efla / "model.safetensors")
    with pytest.raises(ckpt.CheckpointError, match="rope"):
        ckpt.load_checkpoint(efla)


def test_old_checkpoints_without_the_architecture_still_load(tmp_path):
    from safetensors.torch import load_file, save_file

    efla = _save_lm(tmp_path / "efla", "efla")
    delta = _save_lm(tmp_path / "delta", "deltanet")
    save_file(load_file(str(delta / "model.safetensors")), str(efla / "model.safetensors"),
              metadata={"format": ckpt.CHECKPOINT_FORMAT, "step": "1"})  # as the first versions wrote it
    ck = ckpt.load_checkpoint(efla)
    assert ck.step == 1



def test_checkpoints_with_values_older_versions_accepted_still_load(trained, tmp_path):
    """grad_clip -1, keep_last 0 and threads 0 were legal before validation; such checkpoints keep loading."""
    out = copy_run(trained, tmp_path / "run")
    _edit_config(out, lambda m: m["train"].update(grad_clip=-1.0, keep_last=0, threads=0))
    assert ckpt.load_checkpoint(out / "step_00000004").step == 4

# ----------------------------------------------------------------------------- 6. small leftovers

def test_dangling_latest_is_one_clear_message(trained, corpus, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "latest").write_text("step_00000009\n")
    (out / "metrics.jsonl").write_text((trained / "metrics.jsonl").read_text())
    capsys.readouterr()
    assert main(argv(corpus, out, "--resume")) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "latest" in lines[0] and "step_00000009" in lines[0], lines
    assert main(["eval", "--checkpoint", str(out), "--data", str(corpus)]) == 2
    line = error_line(capsys)
    assert "latest" in line and "step_00000009" in line


def test_corrupt_training_state_never_suggests_unsafe_loading(trained, corpus, tmp_path, capsys):
    import argparse

    out = copy_run(trained, tmp_path / "run")
    state = out / "step_00000004" / ckpt.STATE_FILE
    for content in (b"not a pickle at all", None):
        if content is None:
            torch.save({"step": 4, "args": argparse.Namespace(x=1)}, state)   # a global weights_only refuses
        else:
            state.write_bytes(content)
        with pytest.raises(ckpt.CheckpointError) as e:
            ckpt.load_training_state(state.parent)
        msg = str(e.value)
        assert str(state) in msg and len(msg.splitlines()) == 1
        assert "weights_only" not in msg and "weights only" not in msg.lower(), msg
        capsys.readouterr()
        assert main(argv(corpus, out, "--resume", "--steps", "6")) == 2
        line = error_line(capsys)
        assert "training_state.pt" in line and "weights_only" not in line


def test_temp_files_of_dead_processes_are_cleaned_when_a_run_starts(trained, corpus, tmp_path):
    out = copy_run(trained, tmp_path / "run")
    dead, alive = dead_pid(), os.getppid()
    stale = [out / f".tmp-latest.{dead}", out / f".tmp_latest.{dead}", out / f".tmp-metrics.jsonl.{dead}"]
    for p in stale:
        p.write_text("x")
    (out / f".tmp_step_00000006.{dead}").mkdir()
    (out / f".tmp_step_00000006.{dead}" / "model.safetensors").write_bytes(b"half")
    live = out / f".tmp-latest.{alive}"                                # another process, still running
    live.write_text("y")
    assert main(argv(corpus, out, "--resume", "--steps", "5")) == 0
    assert not any(p.exists() for p in stale) and not (out / f".tmp_step_00000006.{dead}").exists()
    assert live.read_text() == "y"


def test_skip_nonfinite_must_be_a_bool():
    from linattn.errors import ConfigError

    with pytest.raises(ConfigError, match="skip_nonfinite"):
        TrainConfig(skip_nonfinite="yes").validate()


def test_trainer_suspends_raising_checks_but_keeps_the_fast_cpu_paths():
    """The training step turns off only the raising value checks; the host reads that pick an equal-result
    faster path (causal_matmul's all-finite shortcut) stay on, and a level the user set is kept."""
    from linattn.ops import _common, get_checks, set_checks, value_checks_suspended

    x = torch.ones(3)
    with value_checks_suspended():
        assert get_checks() == "auto" and not _common.check_values(x) and _common.reads_values(x)
    assert _common.check_values(x)
    previous = set_checks("full")
    try:
        with value_checks_suspended():
            assert _common.check_values(x)
    finally:
        set_checks(previous)
