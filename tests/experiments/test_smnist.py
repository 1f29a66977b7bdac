"""`linattn experiment smnist-robustness`: EFLA's beta variants (adaptive decay, loose beta), --methods,
the standard budget, the paired spread criterion and the evaluation's shortcuts (tiny budgets on fake
MNIST; the real runs are in docs/results/smnist.md)."""
import json
import math

import pytest
import torch
import torch.nn.functional as F

from linattn import cli
from linattn.experiments import build_parser, smnist
from linattn.layers import EFLA
from tests.helpers import fake_mnist

pytestmark = pytest.mark.usefixtures("one_thread_module")

ALL = "deltanet,efla,efla-adaptive,efla-loose"


def _run(argv):
    return cli.main(["experiment", "smnist-robustness", *argv])


def _argv(data, out, *extra):
    return ["--budget", "tiny", "--data", str(data), "--out", str(out), "--no-progress", "--threads", "1", *extra]


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    """One tiny experiment with all four methods: (data folder, results folder, results.json)."""
    root = tmp_path_factory.mktemp("smnist")
    data, out = fake_mnist(root / "mnist"), root / "all"
    assert _run(_argv(data, out, "--methods", ALL)) == 0
    return data, out, json.loads((out / "results.json").read_text())


def test_four_methods_end_to_end(four):
    _, out, rep = four
    runs = {r["method"]: r for r in rep["runs"]}
    assert list(runs) == list(smnist.METHODS)
    for m, r in runs.items():
        assert (out / "runs" / f"{m}-r0.json").is_file()
        assert r["train_seed"] == 42 + smnist.RANK[m] and r["lr"] == smnist.LR[m]
        assert set(r["acc"]) == {"scale", "noise", "dropout"}
        assert all(0 <= a <= 100 for accs in r["acc"].values() for a in accs)
    assert (runs["deltanet"]["train_seed"], runs["efla"]["train_seed"]) == (43, 44)   # unchanged
    assert runs["efla-adaptive"]["softplus_alpha"] > 0 and "softplus_alpha" not in runs["efla"]
    s = rep["summary"]
    assert s["methods"] == list(smnist.METHODS)
    assert set(s["comparisons"]) == {"efla-vs-deltanet", "efla-adaptive-vs-efla", "efla-loose-vs-efla"}
    loose = s["comparisons"]["efla-loose-vs-efla"]
    d = runs["efla-loose"]["acc"]["scale"][0] - runs["efla"]["acc"]["scale"][0]
    assert loose["clean"]["diffs"] == [d] and loose["clean"]["exceeds"] is None   # one replicate
    md = (out / "results.md").read_text()
    assert "Verdict per sweep" in md and "2 · std(d) / √n" in md and "+ in" in md
    for a, b in smnist.PAIRS:
        assert f"**{smnist.LABEL[a]} − {smnist.LABEL[b]}**" in md
    assert "--methods " + ALL in md                          # the command line names the methods
    assert (out / "robustness.png").is_file() and (out / "loss.png").is_file()


def test_deterministic_and_independent_of_the_other_methods(four, tmp_path):
    """The same runs again (here without deltanet and efla) give identical losses and accuracies."""
    data, _, rep = four
    out = tmp_path / "again"
    assert _run(_argv(data, out, "--methods", "efla-loose,efla-adaptive")) == 0   # any order
    again = json.loads((out / "results.json").read_text())["runs"]
    assert [r["method"] for r in again] == ["efla-adaptive", "efla-loose"]
    first = {r["method"]: r for r in rep["runs"]}
    for r in again:
        assert r["acc"] == first[r["method"]]["acc"] and r["losses"] == first[r["method"]]["losses"]


def test_resume_adds_methods(tmp_path, monkeypatch, capsys):
    data = fake_mnist(tmp_path / "mnist")
    out = tmp_path / "sm"
    assert _run(_argv(data, out, "--methods", "efla")) == 0
    calls = []
    real = smnist.train_one
    monkeypatch.setattr(smnist, "train_one", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    assert _run(_argv(data, out, "--methods", "efla,efla-loose", "--resume")) == 0
    assert calls == ["efla-loose"]
    rep = json.loads((out / "results.json").read_text())
    assert [r["method"] for r in rep["runs"]] == ["efla", "efla-loose"]
    assert "efla-loose-vs-efla" in rep["summary"]["comparisons"]


def test_new_methods_keep_the_old_initial_weights():
    """alpha is created last and only for efla-adaptive: every method starts from the same weights for a seed."""
    states, after = {}, {}
    for m in smnist.METHODS:
        torch.manual_seed(44)
        states[m] = smnist.SMNISTClassifier(m, seq_len=20).state_dict()
        after[m] = torch.rand(3)                       # what is drawn next (the data order) is the same too
    assert "beta_alpha" in states["efla-adaptive"]
    assert all(torch.equal(after[m], after["efla"]) for m in smnist.METHODS)
    assert "beta_alpha" not in states["efla"] and "beta_alpha" not in states["efla-loose"]
    for m in smnist.METHODS:
        for k, v in states["efla"].items():
            assert torch.equal(states[m][k], v), (m, k)


def test_beta_definitions_are_the_formulas_and_the_library_layers():
    b = torch.randn(3, 7, 1) * 4
    sig, ada, loose = (smnist.SMNISTClassifier(m, seq_len=8) for m in ("efla", "efla-adaptive", "efla-loose"))
    assert torch.equal(sig.beta_of(b), torch.sigmoid(b))
    assert math.isclose(ada.beta_alpha.item(), math.log(math.e - 1), rel_tol=1e-6)
    assert torch.allclose(ada.beta_of(b), torch.sigmoid(b), rtol=1e-6, atol=0)     # softplus(alpha) = 1 at init
    assert torch.equal(loose.beta_of(b), F.softplus(b))
    assert (loose.beta_of(b) > 1).any()                                             # no upper bound
    with torch.no_grad():
        ada.beta_alpha.fill_(-0.7)
    assert torch.allclose(ada.beta_of(b), math.log1p(math.exp(-0.7)) * torch.sigmoid(b))
    # the same as linattn's EFLA layer with one head (EFLA._beta_of)
    lib_ada, lib_loose = EFLA(8, 1, beta_mode="adaptive"), EFLA(8, 1, beta_mode="loose")
    with torch.no_grad():
        lib_ada.beta_alpha.fill_(-0.7)
    assert torch.equal(ada.beta_of(b), lib_ada._beta_of(b))
    assert torch.equal(loose.beta_of(b), lib_loose._beta_of(b))
    # alpha is learned
    ada(torch.rand(2, 8, 1)).sum().backward()
    assert ada.beta_alpha.grad is not None and ada.beta_alpha.grad.abs().item() > 0


def test_methods_option_and_budgets(tmp_path, capsys):
    assert smnist.parse_methods("efla-loose, deltanet,efla-loose") == ["deltanet", "efla-loose"]
    data = fake_mnist(tmp_path / "mnist")
    assert _run(_argv(data, tmp_path / "o", "--methods", "deltanet,efla-strict")) == 2
    err = capsys.readouterr().err
    assert "--methods" in err and "'efla-strict'" in err and ALL in err
    assert _run(_argv(data, tmp_path / "o", "--methods", ",")) == 2
    assert "no name given" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    _, parser = build_parser("smnist-robustness")
    assert parser.parse_args([]).methods == ["deltanet", "efla"]
    text = parser.format_help()
    assert "{quick,standard,full}" in text and "standard: the paper's training pass" in " ".join(text.split())
    std = smnist.BUDGETS["standard"]
    assert (std.train_images, std.test_images, std.replicates, std.batch_size) == (60_000, 10_000, 5, 128)
    assert std.levels is None and parser.parse_args(["--budget", "standard"]).budget == "standard"


def test_spread_criterion_on_hand_made_numbers():
    def verdict(diffs, subject="EFLA"):
        p = smnist.paired(diffs, [0.0] * len(diffs), subject)
        return p["exceeds"], p["verdict"]

    # mean 2, std 0.71, 2 std / sqrt(5) = 0.63: exceeds
    up = [2.0, 3.0, 1.0, 2.0, 2.0]
    assert verdict(up) == (True, "exceeds the spread (EFLA higher)")
    assert verdict([-d for d in up], "EFLA + loose β") == (True, "exceeds the spread (EFLA + loose β lower)")
    # mean 0.6, std 2.07, bound 1.85: within, although positive in 3 of 5
    mixed = [3.0, -1.0, 2.0, -2.0, 1.0]
    p = smnist.paired(mixed, [0.0] * 5, "EFLA")
    assert p["exceeds"] is False and p["verdict"] == "within the spread" and p["positive"] == 3 and p["n"] == 5
    assert math.isclose(p["bound"], 2 * p["std"] / math.sqrt(5))
    # all of one sign does not suffice: +0.1 and +3.9 (mean 2, bound 2 * 2.83 / 1.41 = 4) is within
    assert verdict([0.1, 3.9]) == (False, "within the spread")
    # identical differences have no spread: any nonzero mean exceeds it, zero does not
    assert verdict([0.5, 0.5])[0] is True and verdict([0.0, 0.0]) == (False, "within the spread")
    exceeds, text = verdict([4.0])
    assert exceeds is None and text.startswith("one replicate")
    assert verdict([]) == (None, "not compared")
    # a missing value drops its pair
    assert smnist.paired([1.0, None, 2.0], [0.0, 5.0, 0.0], "EFLA")["diffs"] == [1.0, 2.0]


def test_evaluation_equals_a_plain_loop_with_fewer_model_calls():
    torch.manual_seed(3)
    model = smnist.SMNISTClassifier("efla", seq_len=16, chunk_size=8)
    images = torch.randint(0, 256, (10, 4, 4), dtype=torch.uint8)
    labels = torch.randint(0, 10, (10,))
    levels = {"scale": [1.0, 3.0], "noise": [0.0, 0.5], "dropout": [0.0, 0.5, 1.0]}

    def plain(bs):   # the evaluation loop before the shortcuts
        out = {}
        with torch.no_grad():
            for sweep, values in levels.items():
                torch.manual_seed(7)
                out[sweep] = []
                for level in values:
                    correct = 0
                    for i in range(0, 10, bs):
                        x = smnist.to_sequence(images[i:i + bs])
                        pred = model(smnist.perturb(x, sweep, level)).argmax(dim=-1)
                        correct += int((pred == labels[i:i + bs]).sum())
                    out[sweep].append(100.0 * correct / 10)
        return out

    calls = []
    model.register_forward_hook(lambda mod, inp, out: calls.append(inp[0].shape[0]))
    fast = smnist.evaluate(model, images, labels, levels, 7, 4, torch.device("cpu"), False)
    # batches of 4, 4, 2: the clean batches once (s = 1; sigma = 0 and p = 0 reuse them), s = 3,
    # sigma = 0.5 and p = 0.5 each, and the all-zero input of p = 1 once per batch shape
    assert calls == [4, 4, 2] * 4 + [4, 2]
    calls.clear()
    assert fast == plain(4)
    assert len(calls) == 21


def test_committed_run_records_are_runs_of_the_standard_protocol():
    """docs/records/smnist-standard holds the run records behind docs/results/smnist.md's (standard budget) EFLA-variant
    tables: they must stay runs of the current standard protocol and plan (so a later session can copy the
    folder to results/ and --resume into it), and summarize them to their own means."""
    from dataclasses import asdict
    from pathlib import Path

    src = Path(__file__).resolve().parents[2] / "docs" / "records" / "smnist-standard"
    runs = [json.loads(p.read_text()) for p in sorted((src / "runs").glob("*.json"))]
    assert runs, f"no run records in {src}"
    exp = json.loads((src / "experiment.json").read_text())
    assert exp["protocol"] == asdict(smnist.BUDGETS["standard"])
    levels = smnist.PAPER_LEVELS
    assert exp["levels"] == levels and exp["seed"] == 42
    for r in runs:   # the plan's seeds, a finished pass over the training set, every level evaluated
        m, rep = r["method"], r["replicate"]
        assert r["run_id"] == f"{m}-r{rep}" and r["finished"]
        assert (r["train_seed"], r["eval_seed"], r["lr"]) == (42 + 1000 * rep + smnist.RANK[m], 42 + 1000 * rep,
                                                              smnist.LR[m])
        assert r["steps"] == 469 and r["train_images"] == 60_000 and len(r["losses"]) == 469
        assert {k: len(v) for k, v in r["acc"].items()} == {k: len(v) for k, v in levels.items()}
        assert r["acc"]["scale"][0] == r["acc"]["noise"][0] == r["acc"]["dropout"][0]   # one clean pass
    s = smnist.summarize(runs, levels)
    for m in s["methods"]:
        clean = [r["acc"]["scale"][0] for r in runs if r["method"] == m]
        assert s["clean"][m][0] == pytest.approx(sum(clean) / len(clean)) and s["clean"][m][2] == len(clean)
