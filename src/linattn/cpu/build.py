"""Compile a kernel source of `csrc/` on first use and cache the shared library per machine.

`load_library(name)` -> `ctypes.CDLL` of `csrc/<name>.c`, or None (the caller then uses PyTorch):

* compiler: `$CC`, else `cc`; flags `-O3 -march=native -fopenmp -shared -fPIC` (and `-fno-trapping-math` where
  the build targets no AVX-512: `NO_MASK_FLAGS`), retried without
  `-march=native` and then without OpenMP (`-fopenmp-simd` keeps the simd pragmas) when refused (a compiler
  that runs past its time limit refused nothing: that build fails and nothing is cached, so a loaded machine
  never leaves a slower library in the cache).
  Never `-ffast-math`: NaN and inf must behave as in the PyTorch forms;
* cache: `<root>/cpu/<key>/<name>.so`, root `$LINATTN_CACHE_DIR`, default `~/.cache/linattn` (the rules on
  who may own and write it are in `libcache.py`), where the key hashes the sources (the .c file and every
  header of csrc/), the flags, the compiler's version and the machine (architecture and CPU model/flags:
  -march=native code must not run on another CPU);
* written durably under a file lock: the compiler writes a temporary file, which is fsynced, renamed into
  place (the folder fsynced) and recorded (size, SHA-256); concurrent processes build once;
* verified: a cached library is loaded only when it matches its record, and after loading it must match its
  table in `abi.LIBRARIES` (the one table of every library's functions, ABI version and plan structs): every
  symbol exported, `linattn_<name>_abi_version()` equal to the table's and each `linattn_sizeof_<plan>()` equal
  to its ctypes struct's size. A mismatch before loading is rebuilt once; what still fails
  gives one notice naming the file, and the PyTorch path runs;
* `LINATTN_CPU_KERNELS=0` turns the compiled kernels off: None, without compiling;
* no compiler or a failed build: one `warnings.warn` notice per library and process, then None.

Nothing here runs at `import linattn`: only a call to `load_library` compiles.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import threading
import time
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ..io import TMP_PREFIX, atomic_write_text, current_umask, fsync_dir, remove_stale_temps
from . import libcache
from .abi import LIBRARIES, symbols

CSRC = Path(__file__).resolve().parent / "csrc"
BASE_FLAGS = ("-O3", "-std=c11", "-ffp-contract=fast", "-shared", "-fPIC")  # FMA contraction: no fast-math
# tried in order; the first set the compiler accepts wins (the key hashes the one that built)
FLAG_SETS = (("-march=native", "-fopenmp"), ("-fopenmp",), ("-march=native", "-fopenmp-simd"), ("-fopenmp-simd",), ())
ENV_SWITCH = "LINATTN_CPU_KERNELS"
#: added to a build that targets no AVX-512 (a CPU without it, or a flag set without -march=native): GCC will not
#: if-convert a loop whose floating-point operations it would have to run speculatively unless it may assume they
#: do not trap (AVX-512's masks let it otherwise), so every clamp in `la_expf` left SiLU, the gates and elu+1 scalar
#: on AVX2. It changes no result (the same IEEE operations; no reassociation), only which loops vectorise.
NO_MASK_FLAGS = ("-fno-trapping-math",)

_LOCK = threading.Lock()
_LOADED: Dict[str, Optional[ctypes.CDLL]] = {}
_NOTICED = set()
_COMPILER_INFO: Dict[str, Optional[str]] = {}
LAST_BUILD: Dict[str, dict] = {}  # name -> {"seconds", "flags", "path", "cached", "rebuilt"} (tests, the bench)


def enabled() -> bool:
    """False when LINATTN_CPU_KERNELS is 0 / false / off / no."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "off", "no")


def cache_root() -> Path:
    """The `cpu/` folder of the first cache root that is safe to use (see `libcache.trusted_root`)."""
    return libcache.trusted_root() / "cpu"


def compiler() -> List[str]:
    """`$CC` split as a shell would (RuntimeError when it cannot be: an unbalanced quote), else `cc`."""
    value = os.environ.get("CC", "").strip()
    try:
        return shlex.split(value) or ["cc"]
    except ValueError as e:
        raise RuntimeError(f"CC={value!r} cannot be split into a command ({e})") from None


def _compiler_version(cc: Tuple[str, ...]) -> Optional[str]:
    """`cc --version`'s first line, or None when there is no working compiler (cached per process)."""
    key = " ".join(cc)
    if key not in _COMPILER_INFO:
        info = None
        if shutil.which(cc[0]) is not None:
            try:
                r = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30)
                if r.returncode == 0:
                    info = (r.stdout.strip().splitlines() or ["unknown"])[0]
            except (OSError, subprocess.SubprocessError):
                info = None
        _COMPILER_INFO[key] = info
    return _COMPILER_INFO[key]


def _machine() -> str:
    """What -march=native depends on: the architecture and the CPU's model and feature flags."""
    parts = [platform.system(), platform.machine()]
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part", "CPU implementer"):
                parts.append(line)
                if len(parts) > 8:
                    break
    except OSError:
        parts.append(platform.processor())
    return "\n".join(parts)


def _has_avx512() -> bool:
    """The CPU reports AVX-512F (x86 Linux: /proc/cpuinfo's flags)."""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.split(":")[0].strip() == "flags":
                return "avx512f" in line.split(":", 1)[1].split()
    except OSError:
        pass
    return False


def target_flags(flags: Tuple[str, ...]) -> Tuple[str, ...]:
    """One of `FLAG_SETS` with `NO_MASK_FLAGS` added unless it builds for this CPU and the CPU has AVX-512."""
    return tuple(flags) if "-march=native" in flags and _has_avx512() else (*flags, *NO_MASK_FLAGS)


def _sources(name: str, src_dir: Path) -> bytes:
    data = (src_dir / f"{name}.c").read_bytes()
    for h in sorted(src_dir.glob("*.h")):
        data += b"\0" + h.name.encode() + b"\0" + h.read_bytes()
    return data


def _key(src: bytes, cc: Tuple[str, ...], version: str) -> str:
    h = hashlib.sha256()
    for part in (src, " ".join(cc).encode(), version.encode(), _machine().encode(), " ".join(BASE_FLAGS).encode(),
                 repr([target_flags(f) for f in FLAG_SETS]).encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:20]


class _FileLock:
    """An exclusive lock on `path` (fcntl; a no-op where fcntl does not exist), held by this process."""

    def __init__(self, path: Path):
        self.path, self.fd = path, None

    def __enter__(self):
        try:
            import fcntl
        except ImportError:  # not POSIX: builds may race, but each still lands by an atomic rename
            return self
        self.fd = os.open(str(self.path), os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            import fcntl

            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
        return False


def _notice(name: str, why: str) -> None:
    if name not in _NOTICED:
        _NOTICED.add(name)
        warnings.warn(f"linattn: the compiled CPU kernels ({name}) are not available ({why}); "
                      "using the PyTorch implementation", stacklevel=3)


COMPILE_TIMEOUT_S = 600


def _compile(cc, src_file: Path, out: Path, flags) -> Tuple[bool, str]:
    cmd = [*cc, *BASE_FLAGS, *flags, f"-I{src_file.parent}", str(src_file), "-o", str(out), "-lm"]
    try:   # its own process group: a timeout stops the driver's cc1 / as too, not only the driver
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    except (OSError, subprocess.SubprocessError) as e:
        return False, str(e)
    try:
        stdout, stderr = proc.communicate(timeout=COMPILE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # a slow machine, not a refused flag: the next flag set would cache a slower library under this key
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (AttributeError, OSError):   # (no process groups here)
            proc.kill()
        proc.communicate()
        out.unlink(missing_ok=True)
        raise RuntimeError(f"the compiler ran past {COMPILE_TIMEOUT_S} s with {' '.join(flags) or 'no extra flags'} "
                           "(nothing cached; the next use tries again)") from None
    return proc.returncode == 0, (stderr or stdout).strip()


def _cached(name: str, target: Path, rebuilt: Optional[str] = None) -> Path:
    LAST_BUILD[name] = {"seconds": 0.0, "path": str(target), "cached": True, "rebuilt": rebuilt}
    return target


def _trusted_folder(key: str, name: str) -> Path:
    """`<root>/cpu/<key>`, created private, in the first root whose folders and files for `name` are safe."""
    while True:
        root = cache_root()
        folder = root / key
        target = folder / f"{name}.so"
        why = libcache.first_problem([folder, target, libcache.record_path(target)])
        if why is None:
            for f in (root, folder):
                if not f.exists():
                    f.mkdir(mode=0o700, exist_ok=True)
            return folder
        if libcache.is_temporary(root.parent):
            raise RuntimeError(f"no safe cache folder ({why})")
        libcache.refuse(root.parent, why)


def _durable(tmp: Path) -> None:
    """Give the compiler's output a mode nobody else can write and push its bytes to the disk before the rename:
    a library renamed before its data is on the disk can be left truncated by a crash."""
    os.chmod(tmp, 0o755 & ~current_umask())
    fd = os.open(str(tmp), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def build(name: str, src_dir: Optional[Path] = None) -> Path:
    """Compile `src_dir/<name>.c` (default csrc/) into the cache unless a verified library is there; returns
    the .so path. A cached library that does not match its build record is rebuilt. Raises RuntimeError
    (with the compiler's message) when no compiler exists or every flag set fails."""
    src_dir = CSRC if src_dir is None else Path(src_dir)
    cc = tuple(compiler())
    version = _compiler_version(cc)
    if version is None:
        raise RuntimeError(f"no C compiler ({' '.join(cc)!r} not found or not working; set CC)")
    key = _key(_sources(name, src_dir), cc, version)
    folder = _trusted_folder(key, name)
    target = folder / f"{name}.so"
    if libcache.mismatch(target) is None:
        return _cached(name, target)
    with _FileLock(folder / f".{name}.lock"):
        why = libcache.mismatch(target)
        if why is None:  # another process built it while we waited
            return _cached(name, target)
        remove_stale_temps(folder)
        return _compile_into(name, cc, src_dir, target, rebuilt=None if why == "not built yet" else why)


def _compile_into(name: str, cc, src_dir: Path, target: Path, rebuilt: Optional[str]) -> Path:
    folder = target.parent
    tmp = folder / f"{TMP_PREFIX}{name}.so.{os.getpid()}"
    t0 = time.perf_counter()
    errors = []
    for flags in map(target_flags, FLAG_SETS):
        ok, msg = _compile(cc, src_dir / f"{name}.c", tmp, flags)
        if ok:
            _durable(tmp)
            record = libcache.describe(tmp)
            os.replace(tmp, target)
            fsync_dir(folder)
            atomic_write_text(libcache.record_path(target), json.dumps(record))  # a crash before: no record
            LAST_BUILD[name] = {"seconds": time.perf_counter() - t0, "flags": list(flags), "path": str(target),
                                "cached": False, "rebuilt": rebuilt}
            return target
        errors.append(f"[{' '.join(flags) or 'no extra flags'}] {msg.splitlines()[0] if msg else 'failed'}")
        tmp.unlink(missing_ok=True)
    raise RuntimeError("the build failed: " + "; ".join(errors))


def is_loaded(name: str) -> bool:
    """Whether this process has loaded `csrc/<name>.c` already (no lock, no build: safe while torch.compile traces)."""
    return _LOADED.get(name) is not None


def load_library(name: str, src_dir: Optional[Path] = None) -> Optional[ctypes.CDLL]:
    """The compiled `csrc/<name>.c` as a ctypes library (built on first use, then cached), or None when the
    kernels are switched off (LINATTN_CPU_KERNELS=0) or cannot be built (one notice, then PyTorch)."""
    if not enabled():
        return None
    key = f"{src_dir}:{name}" if src_dir is not None else name
    with _LOCK:
        if key not in _LOADED:
            try:
                _LOADED[key] = _load_checked(name, build(name, src_dir))
            except (OSError, RuntimeError) as e:
                _notice(name, str(e))
                _LOADED[key] = None
        return _LOADED[key]


def interface_problem(name: str, lib: ctypes.CDLL) -> Optional[str]:
    """Why a loaded library cannot be bound (a symbol of its `abi.LIBRARIES` table missing, another ABI version,
    a plan struct of another size), or None. A library without a table (a test's own source) is not checked."""
    if name not in LIBRARIES:
        return None
    table = LIBRARIES[name]
    missing = [s for s in symbols(name) if not hasattr(lib, s)]
    if missing:
        return f"it does not export {', '.join(missing)}"
    version = getattr(lib, f"linattn_{name}_abi_version")
    version.restype, version.argtypes = ctypes.c_int, []
    if version() != table.abi:
        return f"its ABI version is {version()}, these bindings need {table.abi}"
    for struct_name, struct in table.structs.items():
        size = getattr(lib, f"linattn_sizeof_{struct_name}")
        size.restype, size.argtypes = ctypes.c_int64, []
        if size() != ctypes.sizeof(struct):
            return f"its {struct_name} has {size()} bytes, the binding's {ctypes.sizeof(struct)}"
    return None


def _load_checked(name: str, path: Path) -> ctypes.CDLL:
    """dlopen a verified library and check its interface; a wrong one loses its record, so that the next
    process rebuilds it (this one cannot map a new file under the same name)."""
    lib = ctypes.CDLL(str(path))
    why = interface_problem(name, lib)
    if why is not None:
        libcache.record_path(path).unlink(missing_ok=True)
        raise RuntimeError(f"{path} cannot be used: {why}")
    return lib
