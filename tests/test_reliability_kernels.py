"""Reliability of the compiled-kernel cache (issue 49.1, 49.2): a damaged, replaced or planted library is never
mapped; what cannot be fixed by one rebuild runs the PyTorch path after one notice naming the file; the cache
folder and its libraries must be the user's and not writable by others."""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import linattn
from linattn.cpu import build as cbuild, gatednorm as cpu_gnorm, libcache
from linattn.layers.common import GatedRMSNorm

HAVE_CC = shutil.which("cc") is not None
pytestmark = pytest.mark.skipif(not HAVE_CC, reason="no C compiler (cc): the compiled CPU kernels cannot build")
IS_ROOT = hasattr(os, "getuid") and os.getuid() == 0


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A process state that has loaded, noticed and refused nothing, a private cache and a private home."""
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(cbuild, "_LOADED", {})
    monkeypatch.setattr(cbuild, "_NOTICED", set())
    monkeypatch.setattr(libcache, "_REFUSED", {})
    monkeypatch.setattr(libcache, "_NOTICED", set())
    monkeypatch.setattr(libcache, "_TEMP_ROOT", [])
    (tmp_path / "home").mkdir(mode=0o700)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    monkeypatch.setenv("LINATTN_CACHE_DIR", str(cache))
    return cache


def _run_gatednorm(env) -> subprocess.CompletedProcess:
    # gatednorm rather than linear: the cache logic is the same for every library, and gatednorm.c compiles in a
    # tenth of linear.c's time (these tests build it up to three times in a fresh cache)
    code = textwrap.dedent("""
        import torch
        from linattn.cpu import build, gatednorm
        from linattn.layers.common import GatedRMSNorm
        torch.manual_seed(0)
        norm = GatedRMSNorm(8)
        x, gate = torch.randn(2, 5, 3, 8).unbind(0)
        assert gatednorm.available()
        err = float((gatednorm.gated_rms_norm(norm, x, gate) - norm(x, gate)).abs().max())
        print("max_err", err, "rebuilt", build.LAST_BUILD["gatednorm"].get("rebuilt"))
    """)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)


def test_truncated_library_is_rebuilt_not_mapped(fresh):
    """Before: a truncated library (a crash after the rename, before the data reached the disk) killed every
    process with SIGBUS. After: it fails its build record and is rebuilt once; the call gives the right answer."""
    lib = cbuild.build("gatednorm")
    full = lib.stat().st_size
    env = dict(os.environ)
    with open(lib, "r+b") as f:
        f.truncate(full // 3)
    r = _run_gatednorm(env)
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-2000:]}"
    words = r.stdout.split()
    assert float(words[1]) < 1e-5 and "bytes" in r.stdout  # rebuilt because of the size
    assert lib.stat().st_size == full and libcache.mismatch(lib) is None
    lib.write_bytes(b"")  # a zero-length library: rebuilt too, not a notice in every process
    r = _run_gatednorm(env)
    assert r.returncode == 0 and "not available" not in r.stderr and libcache.mismatch(lib) is None, r.stderr


def test_build_fsyncs_before_the_rename(fresh, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(cbuild.os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                       real_fsync(fd)))
    monkeypatch.setattr(cbuild.os, "replace", lambda a, b: (events.append(("replace", str(b))), real_replace(a, b)))
    lib = cbuild.build("probe")
    i_lib = events.index(("replace", str(lib)))
    assert any(e[0] == "fsync" and cbuild.TMP_PREFIX in e[1] for e in events[:i_lib]), events  # the data first
    assert ("fsync", str(lib.parent)) in events[i_lib:]  # then the folder holding the new name
    assert json.loads(libcache.record_path(lib).read_text())["size"] == lib.stat().st_size


def test_compiler_timeout_caches_nothing_and_tries_no_slower_flags(fresh, monkeypatch):
    """Before: a compile that ran past its time limit on a loaded machine counted as `-march=native` refused, so
    the next flag set's slower library was cached under the same key for good (and the killed driver left its cc1
    running). After: the build fails (the PyTorch path for this process), no other flag set is tried, nothing is
    cached, the compiler's process group is gone, and the next build succeeds."""
    seen = []
    real_popen = cbuild.subprocess.Popen

    def record(cmd, *a, **k):
        seen.append(cmd)
        return real_popen(cmd, *a, **k)

    monkeypatch.setattr(cbuild.subprocess, "Popen", record)
    monkeypatch.setattr(cbuild, "COMPILE_TIMEOUT_S", 0.001)    # no compiler finishes in a millisecond
    with pytest.raises(RuntimeError, match="ran past"):
        cbuild.build("probe")
    assert len(seen) == 1 and "-march=native" in seen[0]           # no fallback to other flag sets
    assert not list(fresh.rglob("probe.so")) and not list(fresh.rglob("*.so.*"))   # nothing cached or left
    monkeypatch.setattr(cbuild, "COMPILE_TIMEOUT_S", 600)
    lib = cbuild.build("probe")
    assert cbuild.LAST_BUILD["probe"]["flags"] == list(cbuild.target_flags(cbuild.FLAG_SETS[0]))
    assert libcache.mismatch(lib) is None


def _forge_record(lib):
    libcache.record_path(lib).write_text(json.dumps(libcache.describe(lib)))


def test_builds_without_avx512_may_assume_no_float_traps(monkeypatch):
    """-fno-trapping-math exactly where the build targets no AVX-512: a CPU without it, or a flag set without
    -march=native (whose code is generic x86-64); an AVX-512 build keeps its flags (and so its cache key)."""
    for has in (True, False):
        monkeypatch.setattr(cbuild, "_has_avx512", lambda: has)
        for flags in cbuild.FLAG_SETS:
            want = tuple(flags) if has and "-march=native" in flags else (*flags, *cbuild.NO_MASK_FLAGS)
            assert cbuild.target_flags(flags) == want


def test_library_without_a_symbol_falls_back_with_one_notice(fresh):
    """Before: a library lacking an expected symbol raised a raw AttributeError from every call. After: one notice
    naming the file and the symbols, the PyTorch path, and the record dropped so that the next process rebuilds."""
    lib = cbuild.build("gatednorm")
    shutil.copyfile(cbuild.build("probe"), lib)  # a wrong library with a record that matches it
    _forge_record(lib)
    with pytest.warns(UserWarning, match=rf"{lib}.*does not export .*linattn_gatednorm_abi_version"):
        assert cbuild.load_library("gatednorm") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        norm, x = GatedRMSNorm(4), torch.randn(1, 6, 4)
        assert torch.equal(cpu_gnorm.gated_rms_norm(norm, x, x.flip(-1)), norm(x, x.flip(-1)))
    assert not libcache.record_path(lib).exists()
    r = _run_gatednorm(dict(os.environ))  # the next process rebuilds it
    assert r.returncode == 0 and "record" in r.stdout and libcache.mismatch(lib) is None, r.stdout + r.stderr


def test_library_of_another_abi_version_is_not_bound(fresh, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(cbuild.CSRC, src)
    text = (src / "gatednorm.c").read_text()
    (src / "gatednorm.c").write_text(text.replace("LA_ABI_VERSION(gatednorm, 1)", "LA_ABI_VERSION(gatednorm, 7)"))
    with pytest.warns(UserWarning, match=r"gatednorm\.so cannot be used: its ABI version is 7, these bindings need 1"):
        assert cbuild.load_library("gatednorm", src) is None


def test_every_source_exports_the_abi_its_bindings_need(fresh):
    """Every csrc/*.c has a LIBRARIES entry, and the built library passes the interface check."""
    sources = sorted(p.stem for p in cbuild.CSRC.glob("*.c"))
    assert sources == sorted(cbuild.LIBRARIES)
    for name in ("probe", "gatednorm"):
        lib = cbuild.load_library(name)
        assert lib is not None and cbuild.interface_problem(name, lib) is None


@pytest.mark.parametrize("cc", ['gcc "', "'"])
def test_unparsable_cc_is_one_notice_not_a_valueerror(fresh, monkeypatch, cc):
    """Before: CC with an unbalanced quote raised a raw ValueError from every default-backend call."""
    monkeypatch.setenv("CC", cc)
    q = torch.randn(1, 5, 2, 4)
    with pytest.warns(UserWarning, match=r"CC=.* cannot be split"):
        assert cbuild.load_library("linear") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(linattn.linear_attention(q, q, q)[0], linattn.linear_attention(q, q, q, backend="torch")[0])


# ------------------------------------------------------------------------------------ who may write the cache

def test_cache_writable_by_others_is_refused(fresh, tmp_path):
    """Before: a LINATTN_CACHE_DIR others can write was used as it is. After: one notice saying why, and the
    build goes to ~/.cache/linattn, created with mode 0700."""
    os.chmod(fresh, 0o777)
    with pytest.warns(UserWarning, match=rf"not using the kernel cache {fresh}: .*writable by group and others"):
        lib = cbuild.build("probe")
    home_cache = tmp_path / "home" / ".cache" / "linattn"
    assert lib.is_relative_to(home_cache) and stat.S_IMODE(home_cache.stat().st_mode) == 0o700
    assert not (fresh / "cpu").exists()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one notice per process
        assert cbuild.build("probe") == lib


def test_everything_unsafe_builds_into_a_private_temporary_folder(fresh, tmp_path):
    os.chmod(fresh, 0o777)
    home = tmp_path / "home"
    (home / ".cache").mkdir()
    os.chmod(home / ".cache", 0o777)  # others could rename ~/.cache/linattn away
    with pytest.warns(UserWarning) as seen:
        lib = cbuild.build("probe")
    temp = libcache._TEMP_ROOT[0]
    assert lib.is_relative_to(temp) and stat.S_IMODE(temp.stat().st_mode) == 0o700
    text = " ".join(str(w.message) for w in seen)
    assert str(fresh) in text and "sticky" in text and str(temp) in text


PLANTED = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) { fputs("ran", f); fclose(f); }
}
int linattn_probe_abi_version(void) { return 1; }
int linattn_probe_threads(int n) { return n; }
void linattn_probe_axpy(void) {}
"""


def _plant(folder, tmp_path):
    """A probe library in the key folder this process would load, whose constructor leaves a marker file."""
    marker = tmp_path / "planted-code-ran"
    src = tmp_path / "planted.c"
    src.write_text(PLANTED)
    cc = tuple(cbuild.compiler())
    key = cbuild._key(cbuild._sources("probe", cbuild.CSRC), cc, cbuild._compiler_version(cc))
    target = folder / "cpu" / key / "probe.so"
    target.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cc", "-shared", "-fPIC", f'-DMARKER="{marker}"', str(src), "-o", str(target)], check=True)
    _forge_record(target)
    return target, marker


@pytest.mark.skipif(not IS_ROOT, reason="giving a file to another uid needs root (CI runs as root)")
def test_library_owned_by_another_user_is_never_loaded(fresh, tmp_path):
    """Before: a library another user placed at cpu/<key>/probe.so (the key is computable) was dlopened and its
    code ran as the user. After: refused with one line saying why; the library is built elsewhere."""
    target, marker = _plant(fresh, tmp_path)
    os.chown(target, 12345, 12345)
    with pytest.warns(UserWarning, match=r"probe\.so is owned by uid 12345, not by you"):
        lib = cbuild.load_library("probe")
    assert lib is not None and not marker.exists()
    assert cbuild.LAST_BUILD["probe"]["path"] != str(target)


def test_library_in_a_folder_others_can_write_is_never_loaded(fresh, tmp_path):
    target, marker = _plant(fresh, tmp_path)
    os.chmod(target.parent, 0o777)
    with pytest.warns(UserWarning, match=r"writable by group and others"):
        assert cbuild.load_library("probe") is not None
    assert not marker.exists()


def test_without_posix_owners_nothing_is_refused(fresh, monkeypatch):
    """Where os.getuid does not exist (Windows) there are no owners or mode bits to check: nothing is refused."""
    os.chmod(fresh, 0o777)
    monkeypatch.delattr(os, "getuid")
    assert libcache.untrusted(fresh) is None
    assert libcache.trusted_root() == fresh
