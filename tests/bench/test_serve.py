"""`linattn bench serve` runs end to end on a tiny checkpoint (few tokens, two loading streams) and writes its
table and JSON; the figures themselves are not checked (speed depends on the machine)."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

from linattn.bench import run_benchmark  # noqa: E402
from tests.helpers import save_tiny_run  # noqa: E402


def test_bench_serve_writes_its_checks(tmp_path, capsys, monkeypatch):
    save_tiny_run(tmp_path / "run")
    monkeypatch.delenv("LINATTN_API_KEY", raising=False)
    n = torch.get_num_threads()
    try:
        assert run_benchmark("serve", ["--model", str(tmp_path / "run"), "--tokens", "4", "--rounds", "2",
                                       "--streams", "2", "--health-samples", "3", "--out", str(tmp_path / "out")]) == 0
    finally:
        torch.set_num_threads(n)
    result = json.loads((tmp_path / "out" / "serve.json").read_text())
    assert len(result["speed"]["rounds"]) == 2 and result["health"]["samples"] == 3
    assert result["health"]["running_at_end"] == 2   # the /health samples were taken while both generated
    assert all(r["generate_tokens_per_s"] > 0 and r["serve_tokens_per_s"] > 0 for r in result["speed"]["rounds"])
    assert "generate / serve (median)" in capsys.readouterr().out


def test_bench_serve_batch_prefix_load_and_state_checks(tmp_path, capsys, monkeypatch):
    save_tiny_run(tmp_path / "run")
    monkeypatch.delenv("LINATTN_API_KEY", raising=False)
    n = torch.get_num_threads()
    try:
        assert run_benchmark("serve", ["--model", str(tmp_path / "run"), "--checks", "batch,prefix,load,state",
                                       "--tokens", "4", "--rounds", "1", "--batch-clients", "3", "--prompt-tokens", "6",
                                       "--prefix-tokens", "20", "--load-clients", "3", "--duration", "1",
                                       "--state-tokens", "8,16", "--out", str(tmp_path / "out")]) == 0
    finally:
        torch.set_num_threads(n)
    result = json.loads((tmp_path / "out" / "serve.json").read_text())
    assert "speed" not in result and len(result["batch"]["rounds"]) == 1 and len(result["prefix"]["rounds"]) == 1
    load = result["load"]
    assert load["requests"] >= 3 and (load["errors"], load["lost"], load["crossed"]) == (0, 0, 0)
    assert load["prefix_cache"]["hits"] + load["prefix_cache"]["misses"] == load["requests"]
    rows = result["state"]["rows"]   # the tiny model is linear attention only: a constant state, no KV cache
    assert [r["tokens"] for r in rows] == [8, 16] and rows[0]["linear_state_bytes"] == rows[1]["linear_state_bytes"] > 0
    assert all(r["kv_bytes"] == 0 for r in rows)
    assert "load: errors / lost / crossed" in capsys.readouterr().out
