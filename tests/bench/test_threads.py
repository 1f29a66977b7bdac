"""`linattn bench threads --quick` end to end, with and without the busy core (no timing assertions)."""
import json
import os
import shutil

import pytest

from linattn.cli import main

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "").strip() or "cc") is None,
                                reason="no C compiler: the compiled CPU kernels cannot build")


@pytest.mark.parametrize("busy", [False, True])
def test_bench_threads_quick(tmp_path, capsys, busy):
    args = ["bench", "threads", "--quick", "--out", str(tmp_path), "--quiet"] + (["--busy-core"] if busy else [])
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "speedup" in out and ("busy-loop process held a core" in out) == busy
    data = json.loads((tmp_path / "threads.json").read_text())
    assert data["busy_core"] == busy and data["machine"]["loadavg_1_5_15min"] is not None
    cases = {(r["level"], r["op"], r["pass"]) for r in data["records"]}
    assert cases == {(lv, op, ps) for lv in ("op", "kernel") for op in ("linear", "gated_deltanet")
                     for ps in ("fwd", "fwd+bwd")}
    for r in data["records"]:
        assert set(r["median_ms"]) == {"1", "2"} and all(len(v) == 2 for v in r["ms"].values())


def test_bench_threads_bad_thread_list_exits_2(capsys):
    assert main(["bench", "threads", "--quick", "--threads", "0,2"]) == 2
    assert "--threads" in capsys.readouterr().err
