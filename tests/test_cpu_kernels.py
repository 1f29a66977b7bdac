"""The compiled CPU backend (issue 34): build + cache, the dispatch, and the kernels against the PyTorch forms
and the fp64 references. Skips with a reason when there is no C compiler (CI has gcc)."""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import linattn
from linattn import cpu
from linattn.cpu import build as cbuild
from linattn.errors import LinattnError
from linattn.ops import backend as B

HAVE_CC = shutil.which(os.environ.get("CC", "").strip() or "cc") is not None
needs_cc = pytest.mark.skipif(not HAVE_CC, reason="no C compiler (cc / $CC): the compiled CPU kernels cannot build")


def _fresh_loader(monkeypatch):
    """Forget what this process loaded / noticed, so that a test sees the first-use path."""
    monkeypatch.setattr(cbuild, "_LOADED", {})
    monkeypatch.setattr(cbuild, "_NOTICED", set())


# --------------------------------------------------------------------------------------- build + cache

@needs_cc
def test_build_then_load_from_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LINATTN_CACHE_DIR", str(tmp_path))
    first = cbuild.build("probe")
    assert cbuild.LAST_BUILD["probe"]["cached"] is False
    assert first.is_file() and first.parent.parent == tmp_path / "cpu"
    stamp = first.stat().st_mtime_ns
    second = cbuild.build("probe")  # the same key: no compiler run, the same file
    assert second == first and cbuild.LAST_BUILD["probe"]["cached"] is True and first.stat().st_mtime_ns == stamp
    assert not [p for p in first.parent.iterdir() if p.name.startswith(".tmp-")]  # no temporary left behind
    lib = ctypes.CDLL(str(second))
    assert lib.linattn_probe_threads(1) == 1
    x, y = torch.ones(37), torch.zeros(37)
    lib.linattn_probe_axpy(ctypes.c_int64(37), ctypes.c_float(2.0), ctypes.c_void_p(x.data_ptr()),
                           ctypes.c_void_p(y.data_ptr()))
    assert torch.equal(y, torch.full((37,), 2.0))


@needs_cc
def test_key_follows_the_source(tmp_path, monkeypatch):
    """An edited source builds into another folder (a stale library is never loaded)."""
    monkeypatch.setenv("LINATTN_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "src"
    src.mkdir()
    (src / "k.c").write_text("int f(void) { return 1; }\n")
    a = cbuild.build("k", src)
    (src / "k.c").write_text("int f(void) { return 2; }\n")
    b = cbuild.build("k", src)
    assert a != b and ctypes.CDLL(str(a)).f() == 1 and ctypes.CDLL(str(b)).f() == 2
    (src / "extra.h").write_text("/* a header of the folder is part of the key */\n")
    assert cbuild.build("k", src) != b


@needs_cc
def test_concurrent_builds_share_one_library(tmp_path):
    """Two processes that build the same library at once: both load it, it is built once (file lock)."""
    script = textwrap.dedent("""
        import ctypes, sys
        from linattn.cpu import build
        path = build.build("probe")
        ctypes.CDLL(str(path)).linattn_probe_threads(1)
        print(build.LAST_BUILD["probe"]["cached"], path)
    """)
    env = dict(os.environ, LINATTN_CACHE_DIR=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted(o[0] for o in outs) == ["False", "True"] and outs[0][1] == outs[1][1]


def test_no_compiler_one_notice_then_none(monkeypatch, tmp_path):
    _fresh_loader(monkeypatch)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.warns(UserWarning, match="compiled CPU kernels .* not available .*no C compiler"):
        assert cbuild.load_library("probe") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one notice per process, not one per call
        assert cbuild.load_library("probe") is None
        assert not cpu.available("probe")


def test_switched_off_builds_nothing(monkeypatch, tmp_path):
    _fresh_loader(monkeypatch)
    monkeypatch.setenv("LINATTN_CPU_KERNELS", "0")
    monkeypatch.setenv("LINATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cbuild, "build", lambda *a, **k: pytest.fail("compiled although switched off"))
    assert cbuild.load_library("probe") is None and not cpu.available("probe")
    assert not (tmp_path / "cpu").exists()


def test_import_compiles_nothing(tmp_path):
    """`import linattn` (and a PyTorch-path call) neither compiles nor creates the cache."""
    env = dict(os.environ, LINATTN_CACHE_DIR=str(tmp_path))
    code = ("import torch, linattn; q = torch.randn(1, 5, 1, 4); "
            "linattn.linear_attention(q, q, q, backend='torch')")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300)
    assert not (tmp_path / "cpu").exists()


# --------------------------------------------------------------------------------------- dispatch

def _problem(q=None, **kw):
    q = torch.zeros(1, 4, 2, 8) if q is None else q
    return linattn.prepare_linear_attention(q, q, q, **kw)


class _NoKernel:
    """A prepared call of an operator that has no compiled kernel."""
    q = torch.zeros(1, 4, 2, 8)


def test_backend_errors_are_linattn_errors(monkeypatch):
    assert issubclass(B.BackendUnavailableError, LinattnError) and issubclass(B.BackendUnavailableError, ImportError)
    assert issubclass(B.BackendDeviceError, LinattnError) and issubclass(B.BackendDeviceError, RuntimeError)
    monkeypatch.setenv("LINATTN_CPU_KERNELS", "0")
    with pytest.raises(B.BackendUnavailableError, match="LINATTN_CPU_KERNELS=0"):
        B.select_backend("cpu", _problem())
    assert B.select_backend("auto", _problem()) == "torch"  # silently


def test_cpu_backend_without_compiler(monkeypatch, tmp_path):
    _fresh_loader(monkeypatch)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(_problem().__class__, "cpu_kernel", "probe", raising=False)
    monkeypatch.setattr(_problem().__class__, "cpu_unsupported", lambda self: None, raising=False)
    with pytest.warns(UserWarning, match="not available"):
        assert B.select_backend("auto", _problem()) == "torch"
    with pytest.raises(B.BackendUnavailableError, match="could not be built"):
        B.select_backend("cpu", _problem())


@needs_cc
def test_cpu_backend_rules(monkeypatch):
    assert "cpu" in B.BACKENDS
    with pytest.warns(UserWarning, match="backend='cpu': _NoKernel has no compiled CPU kernel; falling back"):
        assert B.select_backend("cpu", _NoKernel()) == "torch"
    assert B.select_backend("auto", _NoKernel()) == "torch"
    assert B.select_backend("torch", _problem()) == "torch"
