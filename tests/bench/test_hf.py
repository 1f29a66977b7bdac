"""`linattn bench hf --quick`: runs end to end at tiny sizes and writes its table and JSON (no timing assertions);
its decode rows time consecutive tokens through the compiled whole-model plan where the model has one; `--load N`
holds N busy loops for the run and stops them."""
import json

import pytest
import torch

pytest.importorskip("transformers")

from linattn.bench import run_benchmark  # noqa: E402
from linattn.cli_support import UsageError  # noqa: E402
from linattn.cpu import decode as cpu_decode  # noqa: E402
from tests.helpers import CompiledDecodeCalls  # noqa: E402


def test_bench_hf_quick(tmp_path, capsys):
    rc = run_benchmark("hf", ["--quick", "--threads", "1", "--repeats", "1", "--no-memory", "--quiet",
                              "--out", str(tmp_path)])
    assert rc == 0
    rec = json.loads((tmp_path / "hf.json").read_text())
    cases = {(r["kind"], r["case"], r["T"]) for r in rec["timings"]}
    for kind in ("gdn", "kda", "mamba2", "lightning", "bamba", "granite", "nemotron_h", "qwen3.5-530m"):
        train_T = 16 if kind == "kda" else 32   # (--kda-train-T, said in the output)
        assert {(kind, "prefill", 32), (kind, "prefill", 64), (kind, "decode", 64), (kind, "train", train_T)} <= cases
    assert rec["skipped"] == []
    assert all(r["unpatched_ms"] > 0 and r["patched_ms"] > 0 and r["target"] >= 1.0 for r in rec["timings"])
    assert {r["target"] for r in rec["timings"] if r["kind"] == "qwen3.5-530m"} == {1.0}
    assert rec["peak_rss_bytes"] > 0
    text = (tmp_path / "hf.txt").read_text()
    assert "speedup" in text and "kda      training step at T = 16" in text and "8 consecutive tokens" in text
    assert "qwen3.5-530m the whole model of `linattn bench infer --shape qwen3.5-530m` (--quick: its tiny shape)" \
        in text and "training step at 32 (--530m-T" in text
    assert any(line.startswith("qwen3.5-530m") and " train " in line for line in text.splitlines())


def test_bench_hf_530m_kind_is_bench_infers_shape_at_lengths_of_its_own(monkeypatch, tmp_path):
    """The qwen3.5-530m kind is built from bench infer's shape registry (no copy of the shape here): the named
    shape, the tiny one with --quick; its lengths are its own options, defaults sized for 2 cores."""
    import argparse

    from linattn.bench import hf
    from linattn.bench.infer import SHAPES
    from linattn.hf import bench_models

    monkeypatch.setattr(bench_models, "qwen35_model", lambda shape, dtype, seed: (shape, dtype, seed))
    assert bench_models.build_model("qwen3.5-530m", False, 1024, 3) == (SHAPES["qwen3.5-530m"], torch.float32, 3)
    assert bench_models.build_model("qwen3.5-530m", True, 1024)[0] is SHAPES["tiny"]
    p = argparse.ArgumentParser()
    hf.add_arguments(p)
    a = p.parse_args([])
    assert hf._lengths(a, "qwen3.5-530m") == ([512, 2048], 512, 256)
    assert hf._lengths(a, "gdn") == ([512, 2048, 8192], 2048, 2048) and hf._lengths(a, "kda")[2] == 512
    a = p.parse_args(["--530m-T", "256", "--530m-decode-context", "128", "--530m-train-T", "64", "--T", "4096"])
    assert hf._lengths(a, "qwen3.5-530m") == ([256], 128, 64) and hf._lengths(a, "mamba2")[0] == [4096]
    with pytest.raises(UsageError, match="--530m-train-T must be >= 2"):
        run_benchmark("hf", ["--kinds", "qwen3.5-530m", "--530m-train-T", "1", "--out", str(tmp_path)])


@pytest.mark.parametrize("kind", ["gdn", "qwen3.5-530m"])
def test_bench_hf_pair_shares_its_weights_and_leaves_the_unpatched_model_as_built(kind):
    """The two sides hold one set of parameters (and so of gradients: a 530M pair in 2.1 GB of weights, not 4.2);
    kernelize changed none of them: the unpatched side computes what a freshly built model computes."""
    from linattn.bench import hf
    from linattn.hf.kernelize import torch_fallbacks

    with torch_fallbacks():
        ref, fast = hf.pair(kind, True, 64, seed=5)
        fresh = hf.build_model(kind, True, 64, seed=5)
        assert [n for n, _ in ref.named_parameters()] == [n for n, _ in fast.named_parameters()]
        assert all(p is q for p, q in zip(ref.parameters(), fast.parameters()))
        ids = hf._ids(24, ref.config.vocab_size, 0)
        want = hf.prefill_fn(fresh, ids)()
        torch.testing.assert_close(hf.prefill_fn(ref, ids)(), want, rtol=0, atol=0)
        torch.testing.assert_close(hf.prefill_fn(fast, ids)(), want, rtol=1e-4, atol=1e-4)
        hf.train_fn(fast, ids)()
        grads = [p.grad.clone() for p in ref.parameters()]
        hf.train_fn(ref, ids)()   # starts from no gradient: the patched step's are not added to
        for g, p in zip(grads, ref.parameters()):
            torch.testing.assert_close(p.grad, g, rtol=1e-3, atol=1e-5)


def test_bench_hf_load_holds_busy_loops_for_the_run_and_stops_them(tmp_path, monkeypatch):
    from linattn.bench import threads

    started, inner = [], threads.busy_start

    def busy_start():
        started.append(inner())
        assert started[-1].poll() is None
        return started[-1]

    monkeypatch.setattr(threads, "busy_start", busy_start)
    rc = run_benchmark("hf", ["--quick", "--kinds", "mamba2", "--threads", "1", "--repeats", "1", "--no-memory",
                              "--quiet", "--load", "2", "--out", str(tmp_path)])
    assert rc == 0 and len(started) == 2 and all(p.poll() is not None for p in started)
    rec = json.loads((tmp_path / "hf.json").read_text())
    assert rec["config"]["load"] == 2 and len(rec["load_start"]) == 3
    assert "2 busy-loop process(es) for the whole run" in (tmp_path / "hf.txt").read_text()


@pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler: the compiled kernels are off")
@pytest.mark.parametrize("kind", ["gdn", "mamba2", "granite", "nemotron_h"])
def test_bench_hf_decode_steps_go_through_the_plan(kind, monkeypatch):
    """The timed decode: n consecutive tokens at their own positions after the prompt, each one compiled
    whole-model call (as generation decodes), with the unpatched model's logits."""
    from linattn.bench import hf
    from linattn.hf.kernelize import torch_fallbacks

    calls = CompiledDecodeCalls(monkeypatch)
    with torch_fallbacks():
        ref, fast = hf.pair(kind, True, 64)
        ids = hf._ids(12, 64, 0)
        got, want = (hf.decode_maker(m, ids, 4)()() for m in (fast, ref))
    assert calls.model == 4
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_bench_hf_memory_builder():
    """The builder the memory worker runs: one prefill of each side, patched or not."""
    from linattn.bench import hf
    for patched in (False, True):
        logits = hf.memory_case("mamba2", True, 64, 8, patched)()
        assert logits.shape == (1, 64)
        logits = hf.memory_case("qwen3.5-530m", True, 64, 8, patched)()   # (the shape's own vocabulary)
        assert logits.shape == (1, 256)


def test_bench_hf_bad_arguments(tmp_path):
    with pytest.raises(UsageError, match="--kinds"):
        run_benchmark("hf", ["--kinds", "rwkv", "--out", str(tmp_path)])
    with pytest.raises(UsageError, match="--T must be >= 2"):
        run_benchmark("hf", ["--T", "1", "--out", str(tmp_path)])


def test_bench_hf_load_stops_its_busy_loops_on_sigterm(monkeypatch, tmp_path):
    """A SIGTERM during a run with --load ends it through the code that stops the busy loops (else they would
    outlive the run), and the previous SIGTERM handler is back afterwards."""
    import os
    import signal

    from linattn.bench import hf, threads

    started, inner = [], threads.busy_start
    monkeypatch.setattr(threads, "busy_start", lambda: started.append(inner()) or started[-1])

    def killed(args):
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("not reached: the SIGTERM handler exits")

    monkeypatch.setattr(hf, "_run", killed)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as e:
        run_benchmark("hf", ["--quick", "--load", "1", "--quiet", "--out", str(tmp_path)])
    assert e.value.code == 143 and len(started) == 1 and started[0].poll() is not None
    assert signal.getsignal(signal.SIGTERM) is before


def test_bench_hf_cases_selects_rows_and_logs_each_row_as_measured(tmp_path, capsys):
    """--cases times only the named cases; each row's numbers are on stderr as soon as it is measured."""
    rc = run_benchmark("hf", ["--quick", "--kinds", "mamba2", "--cases", "decode,train", "--threads", "1",
                              "--repeats", "1", "--out", str(tmp_path)])
    assert rc == 0
    rec = json.loads((tmp_path / "hf.json").read_text())
    assert sorted(r["case"] for r in rec["timings"]) == ["decode", "train"]
    assert rec["memory"] == []          # prefill peak memory belongs to the prefill case
    err = capsys.readouterr().err
    row = next(r for r in rec["timings"] if r["case"] == "train")
    assert f"[mamba2] train T=32 threads=1: unpatched {row['unpatched_ms']:.1f} ms" in err
    assert f"{row['speedup']:.2f}x" in err
    with pytest.raises(UsageError, match="--cases: unknown \\['backward'\\]"):
        run_benchmark("hf", ["--cases", "prefill,backward", "--out", str(tmp_path)])
