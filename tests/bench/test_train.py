"""`linattn bench train --quick` end to end (no timing assertions: the machine's speed is not tested)."""
import json

from linattn.cli import main


def test_bench_train_quick(tmp_path, capsys):
    rc = main(["bench", "train", "--quick", "--mixers", "softmax,gated-deltanet,linear-elu+1", "--out", str(tmp_path),
               "--quiet"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "vs softmax" in out
    data = json.loads((tmp_path / "train.json").read_text())
    recs = {r["model"]: r for r in data["records"]}
    assert set(recs) == {"softmax", "gated-deltanet", "linear-elu+1"}
    for r in recs.values():
        assert "error" not in r and r["tokens_per_s"] > 0 and r["step"]["repeats"] >= 2
    assert data["config"]["seq_len"] == 64 and data["config"]["batch"] == 2   # --quick's configuration


def test_bench_train_unknown_mixer_exits_2(capsys):
    assert main(["bench", "train", "--quick", "--mixers", "nope"]) == 2
    assert "unknown" in capsys.readouterr().err
