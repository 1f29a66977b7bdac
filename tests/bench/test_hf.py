"""`linattn bench hf --quick`: runs end to end at tiny sizes and writes its table and JSON (no timing assertions)."""
import json

import pytest

pytest.importorskip("transformers")

from linattn.bench import run_benchmark  # noqa: E402
from linattn.cli_support import UsageError  # noqa: E402


def test_bench_hf_quick(tmp_path, capsys):
    rc = run_benchmark("hf", ["--quick", "--threads", "1", "--repeats", "1", "--no-memory", "--quiet",
                              "--out", str(tmp_path)])
    assert rc == 0
    rec = json.loads((tmp_path / "hf.json").read_text())
    cases = {(r["kind"], r["case"], r["T"]) for r in rec["timings"]}
    for kind in ("gdn", "kda", "mamba2"):
        assert {(kind, "prefill", 32), (kind, "prefill", 64), (kind, "decode", 64), (kind, "train", 32)} <= cases
    assert rec["skipped"] == []
    assert all(r["unpatched_ms"] > 0 and r["patched_ms"] > 0 for r in rec["timings"])
    assert "speedup" in (tmp_path / "hf.txt").read_text()


def test_bench_hf_memory_builder():
    """The builder the memory worker runs: one prefill of each side, patched or not."""
    from linattn.bench import hf
    for patched in (False, True):
        logits = hf.memory_case("mamba2", True, 64, 8, patched)()
        assert logits.shape == (1, 64)


def test_bench_hf_bad_arguments(tmp_path):
    with pytest.raises(UsageError, match="--kinds"):
        run_benchmark("hf", ["--kinds", "rwkv", "--out", str(tmp_path)])
    with pytest.raises(UsageError, match="--T must be >= 2"):
        run_benchmark("hf", ["--T", "1", "--out", str(tmp_path)])
