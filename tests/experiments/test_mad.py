"""`linattn experiment mad`: the standard budget, model seeds, the softmax sanity gate, paired
comparisons and several processes sharing a results folder (tiny budgets; the real runs are in docs/results/mad.md)."""
import json
import math

import pytest

from linattn import cli
from linattn.experiments import common, mad


def _run(argv):
    return cli.main(["experiment", "mad", *argv])


def _run_record(mixer, task, acc, seed=0, setting="baseline"):
    return {"mixer": mixer, "task": task, "acc": acc, "seed": seed, "setting_id": setting}


def test_sanity_gate_passes_fails_and_needs_softmax():
    ok = [_run_record("softmax", "in-context-recall", 0.95), _run_record("softmax", "noisy-in-context-recall", 0.91)]
    assert mad.sanity_gate(ok)["status"] == "passed"
    # one seed below 90% fails the gate, even if another passes
    bad = ok + [_run_record("softmax", "noisy-in-context-recall", 0.5, seed=1),
                _run_record("softmax", "in-context-recall", 0.99, seed=1)]
    gate = mad.sanity_gate(bad)
    assert gate["status"] == "failed" and "invalid" in gate["text"]
    # a non-baseline setting or another mixer does not count
    other = [_run_record("softmax", "in-context-recall", 1.0, setting="vocab_size=32"),
             _run_record("deltanet", "in-context-recall", 1.0), _run_record("deltanet", "noisy-in-context-recall", 1.0)]
    assert mad.sanity_gate(other)["status"] == "not checked"
    # the best lr/wd run of a seed counts
    grid = ok + [_run_record("softmax", "in-context-recall", 0.2)]
    assert mad.sanity_gate(grid)["status"] == "passed"


def test_paired_difference_criterion():
    same_sign = common.paired_difference([10.0, 11.0, 12.0], [9.0, 9.5, 10.0])    # d = 1, 1.5, 2
    assert same_sign["exceeds"] is True and same_sign["positive"] == 3
    assert math.isclose(same_sign["mean"], 1.5)
    noisy = common.paired_difference([10.0, 5.0], [9.0, 8.0])                       # d = 1, -3
    assert noisy["exceeds"] is False and noisy["positive"] == 1
    assert common.paired_difference([1.0], [0.0])["exceeds"] is None               # one pair: no spread
    assert common.paired_difference([1.0, None], [0.0, 2.0])["n"] == 1              # missing values dropped
    text = common.describe_difference(same_sign, "A higher", "B higher")
    assert text.startswith("+1.5 ± 0.5 (+ in 3 of 3)") and text.endswith("exceeds the spread (A higher)")
    assert "within the spread" in common.describe_difference(noisy, "A", "B")


def test_scores_average_seeds_and_settings():
    runs = [_run_record("efla", "memorization", a, seed=s, setting=st)
            for s, st, a in ((0, "baseline", 0.5), (0, "vocab_size=512", 0.1), (1, "baseline", 0.7),
                             (1, "vocab_size=512", 0.3))]
    per_seed = mad.seed_scores(runs, ["efla"], ["memorization"])
    assert per_seed["efla"]["memorization"] == pytest.approx({0: 30.0, 1: 50.0})
    assert mad.score(runs, ["efla"], ["memorization"])["efla"]["memorization"] == pytest.approx(40.0)
    # a seed missing a setting is left out rather than averaged over fewer settings
    partial = mad.seed_scores(runs[:3], ["efla"], ["memorization"])
    assert set(partial["efla"]["memorization"]) == {0}


def test_comparisons_pair_by_seed_and_use_only_seeds_both_mixers_ran():
    tasks = ["in-context-recall", "memorization"]
    runs = [_run_record(m, t, a, seed=s) for m, t, s, a in (
        ("softmax", "in-context-recall", 0, 1.0), ("softmax", "in-context-recall", 1, 0.99),
        ("softmax", "memorization", 0, 1.0),
        ("linear-elu", "in-context-recall", 0, 0.38), ("linear-elu", "in-context-recall", 1, 0.41),
        ("linear-elu", "memorization", 0, 0.7), ("linear-elu", "memorization", 1, 0.8))]
    per_seed = mad.seed_scores(runs, ["softmax", "linear-elu"], tasks)
    (cmp,) = mad.comparisons(per_seed, ["softmax", "linear-elu"], tasks)      # EFLA/DeltaNet absent: skipped
    assert (cmp["a"], cmp["b"]) == ("linear-elu", "softmax")
    recall = cmp["tasks"]["in-context-recall"]
    assert recall["diffs"] == pytest.approx([-62.0, -58.0]) and recall["exceeds"] is True
    # softmax has no seed-1 memorization run: that task and the average pair seed 0 only
    assert cmp["tasks"]["memorization"]["n"] == 1 and cmp["tasks"]["memorization"]["exceeds"] is None
    assert cmp["tasks"]["average"]["diffs"] == pytest.approx([(38 - 100 + 70 - 100) / 2])


def test_standard_budget_trains_on_the_full_recall_sets():
    plan = mad.plan_runs(mad.BUDGETS["standard"], ["softmax"], list(mad.TASK_ORDER), seed=0)
    n = {r["task"]: r["setting"]["num_train_examples"] for r in plan}
    assert n["in-context-recall"] == n["noisy-in-context-recall"] == n["fuzzy-in-context-recall"] == 12_800
    assert all(r["setting"]["num_test_examples"] == 1280 for r in plan)
    assert all(r["setting_id"] == "baseline" for r in plan) and len(plan) == 6


def test_seeds_shared_folder_and_comparison_end_to_end(tmp_path):
    """Two model seeds, EFLA vs DeltaNet paired by seed; a run claimed by another process (its lock
    file held) is skipped and the tables say they are incomplete; a later --resume completes them."""
    from linattn.training.lock import RunLock

    out = tmp_path / "mad"
    base = ["--budget", "tiny", "--mixers", "deltanet,efla", "--tasks", "memorization,compression",
            "--seeds", "2", "--out", str(out), "--no-progress", "--threads", "1"]
    plan = mad.plan_runs(mad.BUDGETS["tiny"], ["deltanet", "efla"], ["memorization", "compression"], 0, 2)
    assert [r["seed"] for r in plan] == [0] * 4 + [1] * 4          # seed-major: the first seed finishes first
    busy = plan[5]["run_id"]
    (out / "runs").mkdir(parents=True)
    with RunLock(out / "runs", busy + ".claim"):                    # "another process" runs this one
        assert _run(base) == 0
    first = json.loads((out / "results.json").read_text())
    assert not first["summary"]["complete"] and len(first["runs"]) == 7
    assert busy not in {r["run_id"] for r in first["runs"]}
    assert "Incomplete: 7 of 8" in (out / "results.md").read_text()
    assert _run(base) == 2                                          # an occupied folder needs --resume
    mtimes = {p.name: p.stat().st_mtime_ns for p in (out / "runs").glob("*.json")}
    assert _run(base + ["--resume"]) == 0
    rep = json.loads((out / "results.json").read_text())
    assert rep["summary"]["complete"] and len(rep["runs"]) == 8 and {r["seed"] for r in rep["runs"]} == {0, 1}
    assert {p.name: p.stat().st_mtime_ns for p in (out / "runs").glob("*.json") if p.name in mtimes} == mtimes
    assert not list((out / "runs").glob("*.claim"))
    (cmp,) = rep["summary"]["comparisons"]
    assert (cmp["a"], cmp["b"]) == ("efla", "deltanet") and cmp["tasks"]["average"]["n"] == 2
    assert rep["summary"]["sanity_gate"]["status"] == "not checked"
    md = (out / "results.md").read_text()
    assert "Sanity gate not checked" in md and "EFLA - DeltaNet, paired by model seed" in md and "±" in md


def test_bad_seeds_is_a_usage_error(tmp_path, capsys):
    assert _run(["--budget", "tiny", "--seeds", "0", "--out", str(tmp_path / "a")]) == 2
    assert "--seeds" in capsys.readouterr().err


def test_report_only_trains_nothing_and_a_resume_may_change_the_selection(tmp_path, capsys):
    out = tmp_path / "mad"
    base = ["--budget", "tiny", "--tasks", "memorization", "--out", str(out), "--no-progress", "--threads", "1"]
    assert _run(base + ["--report-only", "--mixers", "efla"]) == 2          # nothing to report yet
    assert "no finished run" in capsys.readouterr().err
    assert _run(base + ["--mixers", "deltanet"]) == 0
    # the same folder with more mixers and seeds: only report what is finished, train nothing
    assert _run(base + ["--mixers", "deltanet,efla", "--seeds", "2", "--report-only"]) == 0
    rep = json.loads((out / "results.json").read_text())
    assert len(rep["runs"]) == 1 and not rep["summary"]["complete"]
    assert "Incomplete: 1 of 4" in (out / "results.md").read_text()
    assert _run(base + ["--report-only", "--overwrite"]) == 2
    # a resume with another selection adds its runs (the folder's identity is the protocol)
    assert _run(base + ["--mixers", "efla", "--seed", "1", "--resume"]) == 0
    assert len(list((out / "runs").glob("*.json"))) == 2
    # ... but not another protocol
    assert _run(["--budget", "quick", "--tasks", "memorization", "--out", str(out), "--resume"]) == 2
    assert "different configuration" in capsys.readouterr().err


def test_committed_run_records_still_render(tmp_path, capsys):
    """docs/records/mad-standard holds the run records behind docs/results/mad.md's newer-mixer MAD rows: they
    must stay a results folder of the current protocol (so a later session can --resume into it), and
    --report-only must score each mixer from its own records."""
    import shutil
    from pathlib import Path

    src = Path(__file__).resolve().parents[2] / "docs" / "records" / "mad-standard"
    records = [json.loads(p.read_text()) for p in sorted((src / "runs").glob("*.json"))]
    assert records, f"no run records in {src}"
    assert json.loads((src / "experiment.json").read_text())["protocol"] == mad.asdict(mad.BUDGETS["standard"])
    out = tmp_path / "mad-standard"
    shutil.copytree(src, out)
    mixers = sorted({r["mixer"] for r in records})
    seeds = 1 + max(r["seed"] for r in records)
    assert _run(["--budget", "standard", "--out", str(out), "--mixers", ",".join(mixers), "--seeds", str(seeds),
                 "--report-only"]) == 0
    table = json.loads((out / "results.json").read_text())["summary"]["table"]
    cells = {}
    for r in records:
        cells.setdefault((r["mixer"], r["task"]), []).append(100.0 * r["acc"])
    for (mixer, task), accs in cells.items():   # the mean over the seeds that ran
        assert table[mixer][task] == pytest.approx(sum(accs) / len(accs))


def _history_run(mixer, task, seed, epochs):
    """A run record with a per-epoch history of (macro, micro) test accuracy; scored at the last epoch."""
    hist = [{"epoch": i + 1, "test_acc": a, "test_micro_acc": m, "test_stray_classes": s}
            for i, (a, m, s) in enumerate(epochs)]
    return {"mixer": mixer, "task": task, "seed": seed, "setting_id": "baseline", "history": hist,
            "best_epoch": len(hist), "acc": hist[-1]["test_acc"]}


def test_macro_gap_notes_name_stray_predictions_and_missed_early_stops():
    runs = [
        _history_run("ttt-linear", "noisy-in-context-recall", 1,
                     [(0.64, 0.955, 0), (0.7996, 0.9995, 2), (8 / 9 * 0.99993, 0.99993, 1)]),
        _history_run("deltanet", "in-context-recall", 0, [(1.0, 1.0, 0)]),          # solved: no note
        _history_run("softmax", "fuzzy-in-context-recall", 0, [(0.08, 0.14, 0)]),    # far from solved: no note
    ]
    notes = mad.macro_gap_notes(runs)
    body = [line for line in notes if line.startswith("- ")]
    assert len(body) == 1 and body[0].startswith("- TTT-Linear, Noisy Recall, seed 1:")
    assert "macro 88.9 at micro 99.99 (epoch 3, 1 stray class(es))" in body[0]
    assert "epoch(s) 2, 3" in body[0]
    assert mad.macro_gap_notes(runs[1:]) == []
