"""The steps of `linattn bench gpu` one at a time, in-process on CPU (issue 44: each step testable alone), and
the Triton cache archive that gives the next GPU machine a warm start."""
import io
import os
import sys
import tarfile
import time

import pytest
import torch

from linattn.bench import gpu
from linattn.bench.gpu import cpu_scaling, lm, machine, timing, triton_cache
from linattn.bench.gpu.base import Ctx, Report


@pytest.fixture(autouse=True)
def _fla_modules_restored():
    """The bench may put a bare `fla` package (its __init__ not run) in sys.modules; other tests import the real
    one, so each test here leaves sys.modules' fla entries as it found them."""
    before = {n: m for n, m in sys.modules.items() if n == "fla" or n.startswith("fla.")}
    yield
    for n in [n for n in sys.modules if (n == "fla" or n.startswith("fla.")) and n not in before]:
        del sys.modules[n]
    sys.modules.update(before)


def _ctx(tmp_path, plan):
    paths = {"json": tmp_path / "gpu.json", "md": tmp_path / "gpu.md"}
    report = Report(paths, {"budget_s": 60.0, "command": "test", "dry_run": True}, list(gpu.STEPS))
    return Ctx(plan, report, lambda s: None, time.monotonic() + 600)


def test_machine_step_alone(tmp_path):
    plan = gpu.dry_plan()
    ctx, rec = _ctx(tmp_path, plan), {}
    machine.step_machine(ctx, rec, time.monotonic() + 60)
    assert rec["matmul"]["float32"]["gflops"] > 0 and rec["copy"]["GB_per_s"] > 0
    assert dict(rec["table"]["rows"])["CPU cores"] == os.cpu_count()


def test_lm_step_alone_builds_matching_models(tmp_path):
    """The LM rows at the dry plan's size; fla's model (when its package imports) is built at the same
    configuration, with the same parameter count as linattn's Gated DeltaNet within the short conv's and
    norms' few differences, and skipped on CPU with the reason."""
    plan = gpu.dry_plan()
    ctx, rec = _ctx(tmp_path, plan), {}
    lm.step_lm(ctx, rec, time.monotonic() + 600)
    by = {c["model"]: c for c in rec["cases"]}
    assert all(by[m]["status"] == "ok" and by[m]["train_tok_s"] > 0 and by[m]["decode_ms_per_token"] > 0
               for m, mixer in gpu.LM_ROWS if mixer is not None)
    fla = by["fla GatedDeltaNet"]
    assert fla["status"] == "skipped"
    try:
        lm.fla_model(plan["lm"])
    except ImportError:
        return
    assert "CUDA" in fla["note"]


def test_ffn_width_is_flas():
    assert lm.ffn_hidden(1024) == 2816 and lm.ffn_hidden(32) == 256


def test_cpu_scaling_step_alone(tmp_path):
    from linattn import cpu

    if not cpu.available("linear"):
        pytest.skip("compiled CPU kernels unavailable")
    plan = gpu.dry_plan()
    ctx, rec = _ctx(tmp_path, plan), {}
    before = torch.get_num_threads()
    cpu_scaling.step_cpu_scaling(ctx, rec, time.monotonic() + 600)
    assert torch.get_num_threads() == before  # restored
    ones = [c for c in rec["cases"] if c["threads"] == 1]
    assert {c["op"] for c in ones} == set(cpu_scaling.OPS) and all(c["fwd_speedup"] == 1.0 for c in ones)
    assert all(c["status"] == "ok" for c in rec["cases"])


def test_targets_from_rows():
    """auto within 10 % of fla's direct call from T = 8k; faster than SDPA from T = 2k; '-' where none applies."""
    def row(op, impl, T, f, fb):
        return dict(op=op, impl=impl, T=T, fwd_ms=f, fwdbwd_ms=fb, status="ok")

    cases = [row("kda", "auto", 8192, 1.05, 3.0), row("kda", "fla:chunk_kda", 8192, 1.0, 2.5),
             row("sdpa", "flash", 8192, 2.0, 2.0), row("kda", "auto", 1024, 5.0, 5.0),
             row("sdpa", "flash", 1024, 1.0, 1.0), row("kda", "auto", 2048, 0.5, 3.0),
             row("sdpa", "flash", 2048, 1.0, 2.0), dict(op="kda", impl="triton", T=8192, status="error")]
    got = {(r[0], r[1], r[2]): r for r in timing.targets(cases)}
    assert got[("kda", 8192, "fwd")][3:] == [pytest.approx(1.05), pytest.approx(0.525), "yes"]
    assert got[("kda", 8192, "fwd+bwd")][5] == "no"  # 1.2x fla's time, and slower than SDPA
    assert got[("kda", 1024, "fwd")][5] == "-"  # below 2k nothing is promised
    assert got[("kda", 2048, "fwd")][5] == "yes" and got[("kda", 2048, "fwd+bwd")][5] == "no"


def test_targets_with_a_forward_only_fla_row():
    """Where fla-core refuses its gated backward (Hopper, Triton 3.4-3.7.0) its direct-call row has a forward only:
    the forward's target is derived, the fwd+bwd's compares with SDPA alone."""
    cases = [dict(op="linear", impl="auto", T=8192, fwd_ms=2.0, fwdbwd_ms=8.0, status="ok"),
             dict(op="linear", impl="fla:chunk_simple_gla", T=8192, fwd_ms=1.0, status="ok"),
             dict(op="sdpa", impl="flash", T=8192, fwd_ms=4.0, fwdbwd_ms=16.0, status="ok")]
    got = {(r[0], r[1], r[2]): r for r in timing.targets(cases)}
    assert got[("linear", 8192, "fwd")][3:] == [pytest.approx(2.0), pytest.approx(0.5), "no"]
    assert got[("linear", 8192, "fwd+bwd")][3:] == [None, pytest.approx(0.5), "yes"]


def test_fla_rows_forward_only_where_fla_refuses_the_backward(monkeypatch):
    """The direct-call rows of fla's gated chunk kernels skip the backward (fla-core would raise inside it, after
    compiling it) where `linattn.fla.gated_backward_refused` names a reason; other rows and machines time both."""
    import linattn.fla as lfla

    monkeypatch.setattr(lfla, "gated_backward_refused", lambda: "refused (#640)")
    assert timing.fla_backward_refused("fla:chunk_simple_gla") == "refused (#640)"
    assert timing.fla_backward_refused("fla:chunk_gated_delta_rule") == "refused (#640)"
    assert timing.fla_backward_refused("fla:chunk_kda") is None and timing.fla_backward_refused("auto") is None
    monkeypatch.setattr(lfla, "gated_backward_refused", lambda: None)
    assert timing.fla_backward_refused("fla:chunk_simple_gla") is None


def _fake_cache(root, n, size):
    """n kernel folders of incompressible bytes, the later ones newer."""
    for i in range(n):
        d = root / f"kernel{i:02d}"
        d.mkdir(parents=True)
        (d / "k.cubin").write_bytes(os.urandom(size))
        (d / "k.json").write_text('{"name": "k"}')
        os.utime(d, (1000 + i, 1000 + i))


def test_triton_cache_round_trip(tmp_path):
    src = tmp_path / "cache"
    _fake_cache(src, 3, 1000)
    info = triton_cache.pack(str(src), str(tmp_path / "a.tar.gz"))
    assert info["kernels"] == 3 and info["left_out"] == []
    dest = tmp_path / "warm"
    assert triton_cache.unpack(str(tmp_path / "a.tar.gz"), str(dest)) == 6
    for f in src.rglob("*"):
        if f.is_file():
            assert (dest / f.relative_to(src)).read_bytes() == f.read_bytes()


def test_triton_cache_keeps_whole_folders_newest_first_under_the_limit(tmp_path):
    src = tmp_path / "cache"
    _fake_cache(src, 5, 40_000)
    info = triton_cache.pack(str(src), str(tmp_path / "a.tar.gz"), limit=130_000)
    assert info["kernels"] == 3 and sorted(info["left_out"]) == ["kernel00", "kernel01"]
    assert (tmp_path / "a.tar.gz").stat().st_size <= 130_000 + 64 * 2 ** 10
    with tarfile.open(tmp_path / "a.tar.gz") as tar:
        assert {n.split("/")[0] for n in tar.getnames()} == {"kernel02", "kernel03", "kernel04"}


@pytest.mark.parametrize("name", ["../evil", "/abs/evil", "link"])
def test_triton_cache_refuses_an_unsafe_archive(tmp_path, name):
    bad = tmp_path / "bad.tar.gz"
    with tarfile.open(bad, "w:gz") as tar:
        info = tarfile.TarInfo(name)
        if name == "link":
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
            tar.addfile(info)
        else:
            info.size = 3
            tar.addfile(info, io.BytesIO(b"bad"))
    with pytest.raises(ValueError, match="unsafe"):
        triton_cache.unpack(str(bad), str(tmp_path / "dest"))
    assert not (tmp_path / "evil").exists()


def test_triton_cache_flag_unpacks_into_the_cache_dir(tmp_path, monkeypatch):
    src = tmp_path / "cache"
    _fake_cache(src, 2, 100)
    triton_cache.pack(str(src), str(tmp_path / "a.tar.gz"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "tc"))
    monkeypatch.delenv("TRITON_CACHE_AUTOTUNING", raising=False)
    info = triton_cache.prepare_cache_dir(str(tmp_path / "a.tar.gz"))
    assert info["dir"] == str(tmp_path / "tc") and info["unpacked"] == 4
    assert (tmp_path / "tc" / "kernel01" / "k.cubin").is_file()
    assert info["autotuning"] == "1" and os.environ["TRITON_CACHE_AUTOTUNING"] == "1"   # autotuning cached too
    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "0")   # ... unless the caller said otherwise
    assert triton_cache.prepare_cache_dir(None)["autotuning"] == "0"
    monkeypatch.delenv("TRITON_CACHE_DIR")
    info = triton_cache.prepare_cache_dir(None)  # no folder given: a fresh one, named in the environment
    assert os.environ["TRITON_CACHE_DIR"] == info["dir"] and os.path.isdir(info["dir"])


def test_triton_cache_bad_flag(tmp_path):
    from linattn.cli_support import UsageError

    class A:
        out, steps, budget_min, dry_run, overwrite, quiet, wheels = str(tmp_path), ["machine"], 1.0, True, 0, 1, None
        triton_cache = str(tmp_path / "missing.tar.gz")

    with pytest.raises(UsageError, match="--triton-cache"):
        gpu.run(A())
