"""The experiment suite (linattn.experiments) and the MNIST reader: micro budgets end to end,
outputs, resume/refusal/overwrite, metrics and verdict logic. Never reads /work/shared."""
import gzip
import json
import math

import numpy as np
import pytest
import torch

from linattn import cli
from linattn.data.mnist import MNISTError, load_mnist, read_idx, write_idx
from linattn.experiments import EXPERIMENTS, common, mad as mad_exp, smnist
from linattn.io import write_json
from tests.helpers import fake_mnist

# ---------------------------------------------------------------- MNIST reader

def test_idx_reader_roundtrip_gz_and_raw(tmp_path):
    a = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    write_idx(tmp_path / "a.idx3-ubyte.gz", a)
    write_idx(tmp_path / "b.idx3-ubyte", a)
    with gzip.open(tmp_path / "a.idx3-ubyte.gz", "rb") as f:
        head = f.read(16)
    assert head[:4] == bytes([0, 0, 8, 3]) and int.from_bytes(head[4:8], "big") == 2   # idx header, big-endian
    assert np.array_equal(read_idx(tmp_path / "a.idx3-ubyte.gz"), a)
    assert np.array_equal(read_idx(tmp_path / "b.idx3-ubyte"), a)


def test_load_mnist_and_errors(tmp_path):
    root = fake_mnist(tmp_path / "m")
    x, y = load_mnist(root, "train")
    assert x.shape == (40, 28, 28) and x.dtype == torch.uint8 and y.shape == (40,) and y.dtype == torch.int64
    xt, _ = load_mnist(fake_mnist(tmp_path / "raw", gz=False), "test")
    assert xt.shape == (20, 28, 28)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "train-images-idx3-ubyte").write_bytes(b"\x01\x02\x03\x04")
    with pytest.raises(MNISTError):
        read_idx(tmp_path / "bad" / "train-images-idx3-ubyte")
    with pytest.raises(MNISTError):
        load_mnist(tmp_path / "nowhere", "train")
    with pytest.raises(MNISTError):
        load_mnist(tmp_path / "bad", "test")


# ---------------------------------------------------------------- metrics and verdicts

def test_macro_accuracy_matches_torchmetrics_convention():
    m = mad_exp.MacroAccuracy(5)
    preds = torch.tensor([0, 0, 1, 2, 3, 3, 4])
    targs = torch.tensor([0, 1, 1, 2, -100, 2, -100])
    m.update(preds, targs)
    # class 0: 1/1, class 1: 1/2, class 2: 1/2, class 3: predicted (fp) but no support -> 0; 4 ignored
    assert math.isclose(m.compute(), (1 + 0.5 + 0.5 + 0) / 4)
    assert math.isclose(m.micro(), 3 / 5)
    assert m.stray_classes() == 1   # class 3: the one that drags macro below what the targets alone give


def test_smnist_verdict_logic():
    levels = {"scale": [1.0, 2.0]}

    def run(method, r, accs):
        return {"method": method, "replicate": r, "acc": {"scale": accs}}

    hold = [run("deltanet", 0, [50, 20]), run("efla", 0, [60, 50]), run("deltanet", 1, [52, 18]),
            run("efla", 1, [61, 45])]
    s = smnist.summarize(hold, levels)
    assert s["comparisons"]["efla-vs-deltanet"]["sweeps"]["scale"]["area"]["verdict"] == \
        "exceeds the spread (EFLA higher)"
    assert s["curves"]["efla"]["scale"][0]["mean"] == 60.5
    mixed = [run("deltanet", 0, [50, 20]), run("efla", 0, [60, 50]), run("deltanet", 1, [52, 48]),
             run("efla", 1, [40, 30])]
    v = smnist.summarize(mixed, levels)["comparisons"]["efla-vs-deltanet"]["sweeps"]["scale"]["area"]
    assert v["verdict"] == "within the spread" and v["positive"] == 1 and v["n"] == 2


def test_smnist_model_matches_a_python_loop():
    """The library's chunk form gives the public code's recurrence (DeltaNet, EFLA and its beta variants)."""
    torch.manual_seed(0)
    for method in smnist.METHODS:
        model = smnist.SMNISTClassifier(method, seq_len=20, chunk_size=8).double()
        x = torch.rand(3, 20, 1, dtype=torch.float64)
        h = model.act(model.input_proj(x) + model.pos_emb)
        q, k, v = model.q_proj(h), model.k_proj(h), model.v_proj(h)
        b = model.beta_proj(h)
        if method == "efla-adaptive":
            with torch.no_grad():
                model.beta_alpha.fill_(0.3)                    # away from its init, where it is sigmoid
        beta = {"efla-loose": torch.nn.functional.softplus(b),
                "efla-adaptive": math.log1p(math.exp(0.3)) * torch.sigmoid(b)}.get(method, torch.sigmoid(b))
        S = torch.zeros(3, 64, 64, dtype=torch.float64)
        for t in range(20):
            kt, bt = k[:, t], beta[:, t]
            if method != "deltanet":
                lam = (kt * kt).sum(-1, keepdim=True)
                a = -torch.expm1(-bt * lam) / lam
            else:
                kt = torch.nn.functional.normalize(kt, dim=-1)
                a = bt
            a = a.view(-1, 1, 1)
            S = S - a * torch.einsum("bd,bn->bdn", kt, torch.einsum("bd,bdn->bn", kt, S)) \
                + a * torch.einsum("bd,bn->bdn", kt, v[:, t])
        ref = model.classifier(model.norm(torch.einsum("bdn,bd->bn", S, q[:, -1])))
        assert torch.allclose(model(x), ref, atol=1e-10, rtol=1e-8)


# ---------------------------------------------------------------- end to end (micro budgets)

def _run(argv):
    return cli.main(["experiment", *argv])


def test_registry_and_cli_errors(tmp_path, capsys):
    assert set(EXPERIMENTS) == {"mad", "smnist-robustness", "lm", "ela-ablations", "efla-variants", "tlinformer"}
    assert _run(["nosuch"]) == 2 and "unknown experiment" in capsys.readouterr().err
    assert _run(["smnist-robustness", "--budget", "tiny", "--data", str(tmp_path / "missing"),
                 "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    assert "pass --data" in capsys.readouterr().err


def test_smnist_tiny_end_to_end_resume_and_refusal(tmp_path, capsys, monkeypatch):
    data = fake_mnist(tmp_path / "mnist")
    out = tmp_path / "sm"
    argv = ["smnist-robustness", "--budget", "tiny", "--data", str(data), "--out", str(out), "--no-progress",
            "--threads", "1"]
    assert _run(argv) == 0
    for f in ("results.json", "results.md", "robustness.png", "loss.png", "experiment.json",
              "runs/deltanet-r0.json", "runs/efla-r0.json"):
        assert (out / f).is_file(), f
    rep = json.loads((out / "results.json").read_text())
    assert {r["method"] for r in rep["runs"]} == {"deltanet", "efla"}
    assert set(rep["runs"][0]["acc"]) == {"scale", "noise", "dropout"}
    assert "Verdict per sweep" in (out / "results.md").read_text()
    first = {r["run_id"]: r["finished_at"] for r in rep["runs"]}
    capsys.readouterr()

    # without --resume an occupied folder is refused; nothing is overwritten
    assert _run(argv) == 2
    assert "--resume" in capsys.readouterr().err

    # --resume skips finished runs (training must not be called again)
    def boom(*a, **k):
        raise AssertionError("a finished run was retrained")

    monkeypatch.setattr(smnist, "train_one", boom)
    assert _run(argv + ["--resume"]) == 0
    assert "2/2 runs already finished" in capsys.readouterr().out
    rep2 = json.loads((out / "results.json").read_text())
    assert {r["run_id"]: r["finished_at"] for r in rep2["runs"]} == first

    # a resume with another configuration is refused
    assert _run(argv + ["--resume", "--seed", "7"]) == 2
    assert "different configuration" in capsys.readouterr().err
    monkeypatch.undo()

    # one deleted run file is redone on --resume, the other kept
    (out / "runs" / "efla-r0.json").unlink()
    calls = []
    real = smnist.train_one
    monkeypatch.setattr(smnist, "train_one", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    assert _run(argv + ["--resume"]) == 0
    assert calls == ["efla"]


def test_smnist_deterministic_for_a_seed(tmp_path):
    data = fake_mnist(tmp_path / "mnist")
    reps = []
    for name in ("a", "b"):
        argv = ["smnist-robustness", "--budget", "tiny", "--data", str(data), "--out", str(tmp_path / name),
                "--no-progress", "--threads", "1"]
        assert _run(argv) == 0
        reps.append(json.loads((tmp_path / name / "results.json").read_text())["runs"])
    for r1, r2 in zip(*reps):
        assert r1["losses"] == r2["losses"] and r1["acc"] == r2["acc"]


def test_mad_tiny_end_to_end(tmp_path):
    out = tmp_path / "mad"
    argv = ["mad", "--budget", "tiny", "--mixers", "softmax,efla", "--out", str(out), "--no-progress",
            "--threads", "1"]
    assert _run(argv) == 0
    rep = json.loads((out / "results.json").read_text())
    assert len(rep["runs"]) == 12                                   # 6 tasks x 2 mixers
    table = rep["summary"]["table"]
    assert set(table) == {"softmax", "efla"}
    for m in table:
        assert set(table[m]) == {*mad_exp.TASK_ORDER, "average"}
        assert all(0 <= v <= 100 for v in table[m].values())
    md = (out / "results.md").read_text()
    assert "Average" in md and "EFLA paper, Table 2" in md and "65.7" in md
    assert (out / "mad.png").is_file()
    ae = [r for r in rep["runs"] if r["task"] == "compression"]
    assert ae and all(r["epochs_run"] == 1 for r in ae)
    # --overwrite starts over
    assert _run(argv + ["--overwrite", "--tasks", "memorization"]) == 0
    assert len(json.loads((out / "results.json").read_text())["runs"]) == 2


def test_mad_models_have_the_benchmark_shape():
    from linattn.models import LanguageModel

    for key in mad_exp.MIXERS:
        m = mad_exp.build_model(key, "in-context-recall", 16, 32)
        assert isinstance(m, LanguageModel) and m.config.d_model == 128 and m.config.n_layers == 2
        assert m.lm_head is not None and m.config.ffn_hidden == 352
        assert mad_exp.logits_of(m, torch.zeros(2, 32, dtype=torch.long)).shape == (2, 32, 16)
    ae = mad_exp.build_model("deltanet", "compression", 16, 32)
    assert isinstance(ae, mad_exp.MADAutoEncoder)
    assert ae(torch.zeros(3, 32, dtype=torch.long)).shape == (3, 32, 16)


def test_lm_tiny_end_to_end(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    text = "\n".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(600))
    (corpus / "train.txt").write_text(text)
    (corpus / "valid.txt").write_text(text[:4000])
    out = tmp_path / "lm"
    argv = ["lm", "--budget", "tiny", "--data", str(corpus), "--models", "ela-hadamard,ela-lobe-bidir",
            "--out", str(out), "--no-progress", "--threads", "1", "--steps", "2"]
    assert _run(argv) == 0
    rep = json.loads((out / "results.json").read_text())
    runs = {r["model"]: r for r in rep["runs"]}
    assert set(runs) == {"ela-hadamard", "ela-lobe-bidir"}
    assert runs["ela-hadamard"]["causal"] is True
    assert runs["ela-hadamard"]["tokens"] == 2 * 2 * 32 and runs["ela-hadamard"]["tokens_per_s"] > 0
    assert runs["ela-hadamard"]["curve"] and math.isfinite(runs["ela-hadamard"]["val_ppl"])
    assert (out / "lm.png").is_file() and (out / "tokenizer.json").is_file()
    assert "train.txt / valid.txt" in (out / "results.md").read_text()


def test_common_helpers(tmp_path):
    assert common.md_table(["a", "b"], [[1, None]]) == "| a | b |\n| :--- | ---: |\n| 1 |  |"
    assert common.mean_std([1.0, 3.0, None]) == (2.0, math.sqrt(2.0), 2)
    assert common.fmt_pm(2.0, 1.0, 2) == "2.0 ± 1.0" and common.fmt_pm(None, None, 0) == "-"
    write_json(tmp_path / "x.json", {"a": float("nan"), "b": np.float32(1.5), "c": torch.tensor(2)})
    assert json.loads((tmp_path / "x.json").read_text()) == {"a": None, "b": 1.5, "c": 2}


def test_bar_panel_gives_every_series_its_own_colour(tmp_path):
    # MAD plots up to 17 mixers: the default cycle repeats after 10
    for k in (1, 7, 10, 11, 17, 20):
        colors = common.series_colors(k)
        assert len(colors) == k and len({str(c) for c in colors}) == k
    series = {f"m{i}": [float(i), None] for i in range(13)}
    common.bar_panel(tmp_path / "bars.png", ["task", "average"], series, "acc", title="t",
                     errors={"m0": [1.0, None]}, hline=90)
    assert (tmp_path / "bars.png").stat().st_size > 0


def test_mad_full_plan_and_scoring():
    """The full budget is mad-lab's benchmark: every setting x lr {1e-4, 5e-4, 1e-3} x wd {0, 0.1};
    a task's score is the mean over settings of the best run over the grid."""
    plan = mad_exp.plan_runs(mad_exp.BUDGETS["full"], ["efla"], list(mad_exp.TASK_ORDER), seed=0)
    per_task = {}
    for r in plan:
        per_task.setdefault(r["task"], set()).add(r["setting_id"])
    assert {t: len(s) for t, s in per_task.items()} == {
        "compression": 11, "fuzzy-in-context-recall": 11, "in-context-recall": 11, "memorization": 6,
        "noisy-in-context-recall": 14, "selective-copying": 13}
    assert len(plan) == 66 * 6 and len({r["run_id"] for r in plan}) == len(plan)
    assert all(r["epochs"] == 200 and r["setting"]["num_test_examples"] == 1280 for r in plan)
    runs = [dict(task="memorization", mixer="efla", setting_id=s, acc=a)
            for s, a in (("baseline", 0.2), ("baseline", 0.6), ("vocab_size=512", 0.1))]
    table = mad_exp.score(runs, ["efla"], ["memorization"])
    assert math.isclose(table["efla"]["memorization"], (60.0 + 10.0) / 2)
    assert math.isclose(table["efla"]["average"], 35.0)
