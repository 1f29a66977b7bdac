"""Reliability of saves, checkpoints and messages (issue 33, points 1, 2, 5 and 8): any failed write of any
file of a save is one line (CheckpointWriteError, exit 2), a run that filled its disk makes room with a lower
--keep-last, an unreadable newest checkpoint is named (and a resume that would collide with it refused before
any step), every file gets the umask's mode, and the messages after a crash, for a symlink loop and for the
exported tokenizer say what is true."""
import errno
import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from linattn import checkpoint as ckpt
from linattn.cli import main
from linattn.data.sources import scan
from linattn.data.tokenizer import train_tokenizer
from linattn.models.family import build_model, config_to_dict
from linattn.training import read_metrics
from tests.helpers import copy_run, dead_pid, error_line, short_train_argv as argv, tiny_model

ROOT = Path(__file__).resolve().parents[1]
TORCH_SHORT_WRITE = "[enforce fail at inline_container.cc:672] . unexpected pos 909184 vs 909072"

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus):
    """A finished 4-step efla run (checkpoints at steps 2 and 4)."""
    out = tmp_path_factory.mktemp("trained") / "run"
    assert main(argv(corpus, out)) == 0
    return out


@pytest.fixture(scope="module")
def small():
    """(model, model config dict, tokenizer) for direct save_checkpoint calls."""
    torch.manual_seed(0)
    tok = train_tokenizer(["def f(x):\n    return x + 1\n" * 20], vocab_size=280)
    model = build_model(tiny_model(vocab=tok.vocab_size))
    return model, config_to_dict(model.config), tok


def save(small, run, step, **kw):
    model, cfg, tok = small
    kw.setdefault("training_state", {"step": step, "x": torch.zeros(3)})
    return ckpt.save_checkpoint(run, step, model, model_config=cfg, tokenizer=tok, **kw)


# ----------------------------------------------------------------------------- 1. a failed write of any file

def _fail(kind):
    def raiser(*a, **k):
        if kind == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        raise RuntimeError(TORCH_SHORT_WRITE)   # how torch.save reports a short write on a full disk
    return raiser


def _inject(monkeypatch, which, kind):
    """Make the writer of one file of a save fail as a full disk does (an OSError, or torch's RuntimeError)."""
    import pathlib

    import safetensors.torch

    if which == "model.safetensors":
        monkeypatch.setattr(safetensors.torch, "save_file", _fail(kind))
        monkeypatch.setattr(safetensors.torch, "save_model", _fail(kind))
    elif which == "training_state.pt":
        monkeypatch.setattr(ckpt.torch, "save", _fail(kind))
    elif which == "latest":
        monkeypatch.setattr(ckpt, "atomic_write_text", _fail(kind))
    else:   # tokenizer.json, config.json: written with Path.write_text
        real = pathlib.Path.write_text

        def write_text(self, *a, **k):
            if self.name == which:
                _fail(kind)()
            return real(self, *a, **k)
        monkeypatch.setattr(pathlib.Path, "write_text", write_text)


@pytest.mark.parametrize("kind", ["enospc", "torch-runtime-error"])
@pytest.mark.parametrize("which", ["model.safetensors", "tokenizer.json", "training_state.pt", "config.json",
                                   "latest"])
def test_any_failed_file_of_a_save_is_one_line_checkpoint_write_error(small, tmp_path, monkeypatch, which, kind):
    run = tmp_path / "run"
    with monkeypatch.context() as m:   # the first save of a run: no earlier checkpoint
        _inject(m, which, kind)
        with pytest.raises(ckpt.CheckpointWriteError) as e:
            save(small, run, 1)
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and which in msg and "step_00000001" in msg, msg
    if which != "latest":
        assert "no earlier checkpoint exists" in msg, msg
        assert not ckpt.list_checkpoints(run)
    if kind == "enospc":
        assert "the disk is full" in msg and e.value.errno == errno.ENOSPC
    else:
        assert "unexpected pos" in msg and "enforce fail" not in msg, msg
    assert isinstance(e.value, ckpt.CheckpointError) and isinstance(e.value, OSError)

    save(small, tmp_path / "run2", 1)
    with monkeypatch.context() as m:   # a later save: the previous checkpoint is named and intact
        _inject(m, which, kind)
        with pytest.raises(ckpt.CheckpointWriteError) as e:
            save(small, tmp_path / "run2", 2)
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and which in msg and "step_00000001" in msg, msg
    assert ckpt.load_checkpoint(tmp_path / "run2").step == 1
    assert not list((tmp_path / "run2").glob(".tmp*"))


@pytest.mark.parametrize("at_step", [2, 4])
def test_torch_short_write_in_a_training_save_is_one_line_and_exit_2(corpus, tmp_path, capsys, monkeypatch,
                                                                      at_step):
    """Before: torch's RuntimeError went through as a 30-line traceback and exit code 1."""
    out = tmp_path / "run"
    real_save = ckpt.torch.save

    def short_write(obj, f, *a, **k):
        if isinstance(obj, dict) and obj.get("step") == at_step:
            raise RuntimeError(TORCH_SHORT_WRITE)
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(ckpt.torch, "save", short_write)
    capsys.readouterr()
    assert main(argv(corpus, out)) == 2
    line = error_line(capsys)
    assert f"step_0000000{at_step}" in line and "training_state.pt" in line
    assert ("no earlier checkpoint exists" in line) == (at_step == 2), line
    assert ("step_00000002 is intact" in line) == (at_step == 4), line


# one interpreter for both writers (each `import torch` costs seconds): every run under its own soft limit (the hard
# one stays, so the next run may raise it again), its stderr closed by a marker line
_REAL_LIMIT = """
import json, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)     # a write past the limit fails with EFBIG instead of killing
from linattn.cli import main
hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
for limit, argv in json.loads(sys.argv[1]):
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    rc = main(argv)
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    print(f"=== rc {rc}", file=sys.stderr, flush=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_FSIZE and SIGXFSZ as on Linux")
def test_a_real_writer_failure_is_one_line(corpus, tmp_path):
    """The real writers (safetensors in Rust, torch.save in C++) hit a file size limit, as on a full disk: the
    weights (~150 KB) fail under a 100 KB limit, the training state (~310 KB) under 250 KB."""
    cases = [(100_000, "model.safetensors", tmp_path / "w"), (250_000, "training_state.pt", tmp_path / "s")]
    env = dict(os.environ, LINATTN_CPU_KERNELS="0")   # no compiler run under the limit (it writes large files)
    runs = json.dumps([(limit, argv(corpus, out)) for limit, _, out in cases])
    res = subprocess.run([sys.executable, "-c", _REAL_LIMIT, runs], capture_output=True, text=True, timeout=600,
                         cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    parts = res.stderr.split("=== rc ")
    assert len(parts) == len(cases) + 1, res.stderr[-3000:]
    for (_, file, out), err, rc in zip(cases, parts, parts[1:]):
        lines = [ln for ln in err.splitlines() if "error:" in ln]
        assert rc.startswith("2\n") and len(lines) == 1 and "Traceback" not in err, err[-3000:]
        assert file in lines[0] and "step_00000002" in lines[0] and "no earlier checkpoint exists" in lines[0], lines
        assert not list(out.glob(".tmp*")) and not ckpt.list_checkpoints(out)


def test_prune_happens_before_the_write_but_never_leaves_zero_checkpoints(small, tmp_path, monkeypatch):
    """keep_last k: when the new weights are written only k - 1 older checkpoints are left (at least one),
    so the disk never holds more than max(k, 2). Before: k older ones were still there."""
    import safetensors.torch

    real = safetensors.torch.save_file
    seen = []

    def spy(tensors, path, *a, **k):
        seen.append([p.name for p in ckpt.list_checkpoints(Path(path).parent.parent)])
        return real(tensors, path, *a, **k)

    monkeypatch.setattr(safetensors.torch, "save_file", spy)
    for keep, run in ((2, tmp_path / "k2"), (1, tmp_path / "k1")):
        seen.clear()
        for step in (1, 2, 3, 4):
            save(small, run, step, keep_last=keep)
        assert [p.name for p in ckpt.list_checkpoints(run)] == [f"step_0000000{s}" for s in range(5 - keep, 5)]
        assert all(len(names) == (min(step, max(keep - 1, 1))) for step, names in enumerate(seen)), seen
    assert seen[-1] == ["step_00000003"]                             # keep 1: the newest stays until replaced


def test_a_run_that_filled_its_disk_makes_room_with_a_lower_keep_last(corpus, tmp_path, capsys, monkeypatch):
    """A disk that holds two checkpoints: with --keep-last none the third save fails, naming the older
    checkpoints that --keep-last 1 removes; the resume with --keep-last 1 then goes on to the end.
    Before: the resume failed the same way (pruning came after a successful save only)."""
    out = tmp_path / "run"
    real_save = ckpt.torch.save

    def small_disk(obj, f, *a, **k):
        if len(ckpt.list_checkpoints(out)) >= 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(ckpt.torch, "save", small_disk)
    capsys.readouterr()
    assert main(argv(corpus, out, "--save-every", "1", "--keep-last", "none")) == 2
    line = error_line(capsys)
    assert "step_00000003" in line and "the disk is full" in line and "step_00000002 is intact" in line, line
    assert "--resume" in line and "--keep-last 1" in line and "step_00000001" in line, line
    assert main(argv(corpus, out, "--save-every", "1", "--keep-last", "1", "--resume")) == 0
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step_00000004"]
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]


# ----------------------------------------------------------------------------- 2. an unreadable newest checkpoint

def _break_config(step_dir):
    (step_dir / "config.json").write_text('{"model": ')


def test_an_unreadable_newest_checkpoint_is_named_in_one_warning(trained, corpus, tmp_path, capsys):
    """Before: generate, eval and load_checkpoint used step 2 without a word."""
    out = copy_run(trained, tmp_path / "run")
    _break_config(out / "step_00000004")
    capsys.readouterr()
    assert ckpt.load_checkpoint(out).step == 2
    assert ckpt.load_checkpoint(out).step == 2                         # once per process, not per call
    warn = [ln for ln in capsys.readouterr().err.splitlines() if "warning" in ln]
    assert len(warn) == 1, warn
    assert "step_00000004" in warn[0] and "config.json is not valid JSON" in warn[0] and "line 1 column 11" in warn[0]
    assert "using" in warn[0] and "step_00000002" in warn[0] and "error" not in warn[0].lower()

    out2 = copy_run(out, tmp_path / "run2")
    assert main(["generate", "--checkpoint", str(out2), "--max-new-tokens", "2"]) == 0
    warn = [ln for ln in capsys.readouterr().err.splitlines() if "warning" in ln]
    assert len(warn) == 1 and "step_00000004" in warn[0] and "line 1 column 11" in warn[0], warn


def test_a_resume_that_would_save_onto_it_is_refused_before_any_step(trained, corpus, tmp_path, capsys):
    """Before: the resume trained steps 3 and 4 from step 2, then died at the save of step 4."""
    out = copy_run(trained, tmp_path / "run")
    _break_config(out / "step_00000004")
    metrics = (out / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert main(argv(corpus, out, "--resume", "--steps", "6")) == 2
    line = error_line(capsys)
    assert "step_00000004" in line and "not valid JSON" in line and "step_00000002" in line, line
    assert (out / "metrics.jsonl").read_bytes() == metrics and not (out / "step_00000006").exists()
    assert (out / "step_00000004" / "config.json").read_text() == '{"model": '   # left as it is
    assert main(argv(corpus, out, "--resume", "--steps", "3", "--save-every", "3")) == 0   # no save lands there


def test_a_step_folder_with_invalid_config_says_so(trained, corpus, tmp_path, capsys):
    """Before: "no readable checkpoint in ... (expected config.json and model.safetensors ...)"."""
    out = copy_run(trained, tmp_path / "run")
    _break_config(out / "step_00000004")
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.load_checkpoint(out / "step_00000004")
    msg = str(e.value)
    assert "config.json is not valid JSON" in msg and "line 1 column 11" in msg and "expected config.json" not in msg
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(out / "step_00000004"), "--data", str(corpus)]) == 2
    assert "config.json is not valid JSON" in error_line(capsys)
    (out / "step_00000004" / "model.safetensors").unlink()
    with pytest.raises(ckpt.CheckpointError, match="has no model.safetensors"):
        ckpt.load_checkpoint(out / "step_00000004")


# ----------------------------------------------------------------------------- 5. file modes

@pytest.fixture
def umask():
    old = os.umask(0o022)
    try:
        yield lambda mask: os.umask(mask)
    finally:
        os.umask(old)


def _modes(folder):
    return {p.relative_to(folder).as_posix(): stat.S_IMODE(p.stat().st_mode)
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077])
def test_every_checkpoint_file_gets_the_umask_mode(small, tmp_path, umask, mask):
    """Before: model.safetensors was 0600 whatever the umask (safetensors' temporary file)."""
    umask(mask)
    run = tmp_path / "run"
    save(small, run, 1)
    save(small, run, 1)                                               # re-saving the same step
    modes = _modes(run)
    assert set(modes) == {"latest", "step_00000001/model.safetensors", "step_00000001/config.json",
                          "step_00000001/tokenizer.json", "step_00000001/training_state.pt"}
    assert set(modes.values()) == {0o666 & ~mask}, {k: oct(v) for k, v in modes.items()}


def test_exported_and_saved_pretrained_folders_get_the_umask_mode(trained, tmp_path, umask):
    pytest.importorskip("transformers")
    from linattn.hf import LinattnForCausalLM, export_hf

    out = export_hf(trained, tmp_path / "hf")
    modes = _modes(out)
    assert "model.safetensors" in modes and set(modes.values()) == {0o644}, {k: oct(v) for k, v in modes.items()}
    umask(0o002)
    LinattnForCausalLM.from_pretrained(out).save_pretrained(tmp_path / "again")
    modes = _modes(tmp_path / "again")
    assert "model.safetensors" in modes and set(modes.values()) == {0o664}, {k: oct(v) for k, v in modes.items()}


# ----------------------------------------------------------------------------- 8. messages

def test_after_a_kill_during_data_preparation_the_messages_agree(corpus, tmp_path, capsys):
    """A run killed before its first checkpoint leaves a lock naming it. Before: "no checkpoint ...; starting a
    new run" and then "its last complete checkpoint is used as it is"."""
    from linattn.training.lock import LOCK_FILE

    out = tmp_path / "run"
    (out / "data_cache").mkdir(parents=True)
    (out / LOCK_FILE).write_text(json.dumps({"pid": dead_pid(), "host": socket.gethostname()}))
    capsys.readouterr()
    assert main(argv(corpus, out, "--resume", "--steps", "2")) == 0
    err = capsys.readouterr().err
    assert "starting a new run" in err
    died = [ln for ln in err.splitlines() if "died" in ln]
    assert len(died) == 1 and "left no complete checkpoint" in died[0] and "is used" not in died[0], died

    (out / LOCK_FILE).write_text(json.dumps({"pid": dead_pid(), "host": socket.gethostname()}))
    assert main(argv(corpus, out, "--resume", "--steps", "3")) == 0
    died = [ln for ln in capsys.readouterr().err.splitlines() if "died" in ln]
    assert len(died) == 1 and "its last complete checkpoint, step_00000002, is intact" in died[0], died


def test_a_symlink_loop_or_dangling_link_as_data_says_so(corpus, tmp_path, capsys):
    """Before: both were "data path not found"."""
    loop, dangling = tmp_path / "loop", tmp_path / "dangling"
    os.symlink(loop.name, loop)
    os.symlink("nowhere.txt", dangling)
    for path, words in ((loop, "symbolic link loop"), (dangling, "symbolic link to nowhere.txt, which does not exist"),
                        (tmp_path / "absent", "data path not found")):
        capsys.readouterr()
        assert main(["train", "--data", str(path), "--out", str(tmp_path / "run"), "--steps", "1"]) == 2
        assert words in error_line(capsys)
        assert main(["eval", "--checkpoint", str(tmp_path), "--data", str(path)]) == 2
        assert words in error_line(capsys)
        with pytest.raises(Exception, match=words):
            scan(path)


_LOAD_TOKENIZER = """
import builtins, json, sys
asked = []
builtins.input = lambda *a: (asked.append(a), "n")[1]   # transformers' "Do you wish to run the custom code?"
from transformers import AutoTokenizer, PreTrainedTokenizerFast
how = sys.argv[2]
if how == "fast":
    t = PreTrainedTokenizerFast.from_pretrained(sys.argv[1])
elif how == "auto-no-remote-code":
    t = AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=False)
else:
    t = AutoTokenizer.from_pretrained(sys.argv[1])
print(json.dumps({"ids": t("def f(x")["input_ids"], "eos": t.eos_token, "pad": t.pad_token, "side": t.padding_side,
                  "asked": len(asked), "linattn": any(m.startswith("linattn") for m in sys.modules)}))
"""


def _load_tokenizer_alone(folder, how, tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    res = subprocess.run([sys.executable, "-c", _LOAD_TOKENIZER, str(folder), how], capture_output=True, text=True,
                         env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    pytest.importorskip("transformers")
    from linattn.hf import export_hf

    return export_hf(trained, tmp_path_factory.mktemp("hf") / "hf")


@pytest.mark.parametrize("how", ["fast", "auto-no-remote-code"])
def test_the_exported_tokenizer_loads_without_linattn_and_without_a_prompt(trained, exported, tmp_path, how):
    cfg = json.loads((exported / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and "auto_map" not in cfg   # a stock class only
    got = _load_tokenizer_alone(exported, how, tmp_path)
    tok = ckpt.load_checkpoint(trained).tokenizer
    assert got == {"ids": tok.encode("def f(x"), "eos": "<|endoftext|>", "pad": "<|endoftext|>", "side": "left",
                   "asked": 0, "linattn": False}


@pytest.mark.xfail(strict=True, reason="transformers 5 (5.23, 5.24) reads config.json before the tokenizer config, "
                                       "and its auto_map (needed for trust_remote_code) makes it ask; the README "
                                       "shows the calls that do not ask")
def test_plain_autotokenizer_on_an_exported_folder_asks_nothing(exported, tmp_path):
    assert _load_tokenizer_alone(exported, "auto", tmp_path)["asked"] == 0
