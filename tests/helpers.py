"""Helpers shared by several test files: `from tests.helpers import ...` (tests/ is a package, so test modules in
different folders may share a basename; a test file never imports another test file, tests/test_structure.py checks).
"""
from __future__ import annotations

import ast
import contextlib
import os
import random
import shutil
from pathlib import Path
from typing import Dict, List, Set

import numpy as np
import torch

from linattn.data.mnist import write_idx
from linattn.models import LMConfig
from linattn.models.registry import build_mixer

ROOT = Path(__file__).resolve().parents[1]   # the repository
SRC = ROOT / "src"
PKG = "linattn"
FIXTURES = ROOT / "tests" / "fixtures"       # checked-in files the tests read (not a package: nothing to collect)


def perturbed_mixer(name: str, d: int = 32, H: int = 2, dtype: torch.dtype = torch.float32, **kw):
    """A registered mixer in eval mode whose biases and norm weights are moved off their initial values, so a
    decode path that skips a bias or a norm cannot agree with the reference by accident (seeded)."""
    torch.manual_seed(0)
    layer = build_mixer(name, d, H, **kw).to(dtype).eval()
    with torch.no_grad():
        for n, p in layer.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    return layer


# ----------------------------------------------------------------------------- the source tree's import graph


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def src_modules() -> Dict[str, Path]:
    """Every module of src/linattn by dotted name."""
    return {_module_name(p): p for p in (SRC / PKG).rglob("*.py")}


def _resolve(current: str, is_pkg: bool, node: ast.ImportFrom, names: Set[str]) -> List[str]:
    base = current if is_pkg else current.rsplit(".", 1)[0]
    if node.level:
        parts = base.split(".")
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts)
        target = f"{base}.{node.module}" if node.module else base
    else:
        target = node.module or ""
    out = []
    if not target.startswith(PKG):
        return out
    for alias in node.names:  # `from . import common` imports the submodule common
        sub = f"{target}.{alias.name}"
        out.append(sub if sub in names else target)
    return out


def import_graph() -> Dict[str, Set[str]]:
    """Module -> the linattn modules it imports (imports inside functions count; TYPE_CHECKING ones do not)."""
    mods = src_modules()
    names = set(mods)
    graph: Dict[str, Set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
                node.body = []  # typing-only imports never run
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                targets = _resolve(mod, is_pkg, node, names)
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith(PKG)]
            else:
                continue
            for t in targets:
                while t not in names and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t in names and t != mod:
                    graph[mod].add(t)
    return graph


_GRAPH: Dict[str, Set[str]] = {}


def import_graph_once() -> Dict[str, Set[str]]:
    """import_graph(), parsed once per session (parsing all of src/ takes seconds): a fresh copy each call, so a
    test may change what it gets."""
    if not _GRAPH:
        _GRAPH.update(import_graph())
    return {m: set(ts) for m, ts in _GRAPH.items()}


# ----------------------------------------------------------------------------- training runs


WORDS = ["alpha", "beta", "gamma", "delta", "def", "return", "class", "lambda", "yield", "import",
         "self", "None", "print", "value", "x"]


def make_corpus(path, n_lines=400, seed=0):
    """A small code-like text file at `path` (seeded): the corpus of the training tests."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        # a learnable pattern: "name = name + 1" statements and random words
        w = rng.choice(WORDS)
        lines.append(f"{w} = {w} + {rng.randint(0, 9)}  # " + " ".join(rng.choice(WORDS) for _ in range(6)))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def tiny_model(vocab=300, **kw):
    """The LMConfig of a 2-layer, 32-wide linear-attention model (override any field)."""
    args = dict(vocab_size=vocab, d_model=32, n_layers=2, n_heads=2, mixer="linear-elu+1", max_seq_len=64)
    args.update(kw)
    return LMConfig(**args)


def train_argv(corpus, out, *extra):
    """`linattn train` flags of a tiny 12-step efla run on `corpus` into `out`."""
    return ["train", "--data", str(corpus), "--out", str(out), "--mixer", "efla", "--vocab-size", "300",
            "--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--seq-len", "32", "--batch-size", "4",
            "--steps", "12", "--lr", "3e-3", "--warmup", "2", "--log-every", "4", "--save-every", "6",
            "--eval-every", "6", "--eval-batches", "2", "--threads", "1", "--no-progress", *extra]


def short_train_argv(corpus, out, *extra):
    """train_argv's tiny run, shorter: 4 steps, a record every step, a checkpoint every 2, no evaluation
    (a later flag wins in argparse, and `extra` comes last)."""
    return train_argv(corpus, out, "--steps", "4", "--warmup", "1", "--log-every", "1", "--save-every", "2",
                      "--eval-every", "0", "--eval-batches", "1", *extra)


def dead_pid() -> int:
    """A pid no process can have (above the kernel's pid_max)."""
    try:
        return int(Path("/proc/sys/kernel/pid_max").read_text()) + 1
    except (OSError, ValueError):
        return 2 ** 30


def error_line(capsys) -> str:
    """The one error line on stderr (progress lines aside), and no traceback."""
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "error" in ln]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def copy_run(src, dst):
    """A copy of run folder `src` at `dst`."""
    shutil.copytree(src, dst)
    return dst


# ----------------------------------------------------------------------------- data


def fake_mnist(root, n_train=40, n_test=20, gz=True, seed=0):
    """MNIST's four idx files of random digits under `root` (gzipped or not), as the reader expects them."""
    g = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    ext = ".gz" if gz else ""
    for split, n in (("train", n_train), ("t10k", n_test)):
        write_idx(root / f"{split}-images-idx3-ubyte{ext}", g.integers(0, 256, size=(n, 28, 28), dtype=np.uint8))
        write_idx(root / f"{split}-labels-idx1-ubyte{ext}", g.integers(0, 10, size=(n,), dtype=np.uint8))
    return root


def save_tiny_run(run_dir, text: str = "def f(x):\n    return x + 1\n" * 20, vocab: int = 280):
    """A run folder holding one checkpoint (step 1) of a tiny seeded LM (`tiny_model`) with a BPE tokenizer trained
    on `text`: what `linattn generate` and `linattn serve` load. Returns the tokenizer."""
    from linattn.checkpoint import save_checkpoint
    from linattn.data.tokenizer import train_tokenizer
    from linattn.models import LanguageModel

    tok = train_tokenizer([text], vocab_size=vocab)
    torch.manual_seed(0)
    cfg = tiny_model(vocab=tok.vocab_size)
    save_checkpoint(run_dir, 1, LanguageModel(cfg), model_config=cfg.to_dict(), tokenizer=tok)
    return tok


# ----------------------------------------------------------------------------- processes


def run_fresh_python(code: str) -> None:
    """Run `code` in a new Python process (what `import linattn` loads, seen from a clean interpreter), without
    TRITON_INTERPRET (the Triton tests set it for this process); fails with the child's stderr."""
    import os
    import subprocess
    import sys

    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]


# One clean interpreter answers the "what does `import linattn` pull in" checks of several test files (each child
# pays `import torch`, seconds under load). Stages run in this order; after each the child records sys.modules and
# whether the compiled-kernel cache folder exists. `import`: `import linattn` alone; `lock`: then
# linattn.RunFolderBusy; `linear`, `torch`: then PyTorch-path calls; `picks`: then select_backend's picks (which may
# build the CPU kernels); `fla`: then explain and a refused backend='fla' call; `serve`: then the serve and cli
# modules and the parser.
_PROBE = """
import json, os, sys
out, cache = {}, os.path.join(os.environ["LINATTN_CACHE_DIR"], "cpu")
def stage(step, **kw):
    out[step] = dict(modules=sorted(sys.modules), cache=os.path.exists(cache), **kw)
import linattn
stage("import")
stage("lock", name=linattn.RunFolderBusy.__name__)
import torch
from linattn.ops.backend import select_backend
q = torch.randn(1, 8, 1, 4)
linattn.linear_attention(q, q, q, backend="torch")
stage("linear")
linattn.delta_rule(q, q, q, torch.rand(1, 8, 1), backend="torch")
stage("torch")
os.environ.pop("LINATTN_CACHE_DIR")   # the picks may build the CPU kernels: into the session's own cache, built already
if os.environ.get("LINATTN_PROBE_CACHE"):
    os.environ["LINATTN_CACHE_DIR"] = os.environ["LINATTN_PROBE_CACHE"]
stage("picks", picks=[select_backend("auto", linattn.prepare_linear_attention(q, q, q)),
                      select_backend("auto", linattn.prepare_delta(q, q, q, q[..., 0].abs()))])
linattn.explain("delta_rule", q, q, q, torch.rand(1, 8, 1))
try:
    linattn.delta_rule(q, q, q, torch.rand(1, 8, 1), backend="fla")
    refused = False
except linattn.BackendDeviceError:
    refused = True
stage("fla", refused=refused)
import linattn.serve, linattn.serve.settings, linattn.cli
linattn.cli.build_parser()
stage("serve")
print(json.dumps(out))
"""
_PROBED: dict = {}


def fresh_import_probe() -> dict:
    """_PROBE's stages -> {"modules": set of module names, "cache": bool, ...}, run once per session in a new
    Python process (without TRITON_INTERPRET; with an empty cache folder of its own up to the picks, then the usual
    one, so that nothing is compiled again)."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    if not _PROBED:
        with tempfile.TemporaryDirectory() as tmp:
            env = dict(os.environ, LINATTN_CACHE_DIR=tmp, LINATTN_PROBE_CACHE=os.environ.get("LINATTN_CACHE_DIR", ""))
            env.pop("TRITON_INTERPRET", None)
            r = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        for name, rec in json.loads(r.stdout.strip().splitlines()[-1]).items():
            _PROBED[name] = dict(rec, modules=set(rec["modules"]))
    return _PROBED


class CompiledDecodeCalls:
    """Counts the compiled decoding calls (monkeypatched entry points of linattn.cpu.decode): `model`, the whole-model
    steps (a greedy loop's call counts the steps it ran); `block`, the per-block calls."""

    def __init__(self, monkeypatch):
        from linattn.cpu import decode as cpu_decode

        self.model = self.block = 0
        inner_fn, inner_greedy, inner_block = cpu_decode.model_function, cpu_decode.greedy_function, \
            cpu_decode.block_step

        def model_function(dtype):
            fn = inner_fn(dtype)

            def counted(*a):
                self.model += 1
                return fn(*a)
            return counted

        def greedy_function(dtype):
            fn = inner_greedy(dtype)

            def counted(*a):
                steps = fn(*a)
                self.model += max(int(steps), 0)
                return steps
            return None if fn is None else counted

        def block_step(*a):
            self.block += 1
            return inner_block(*a)

        monkeypatch.setattr(cpu_decode, "model_function", model_function)
        monkeypatch.setattr(cpu_decode, "greedy_function", greedy_function)
        monkeypatch.setattr(cpu_decode, "block_step", block_step)


def torch_decode_twin(model, dtype=None):
    """A copy of `model` (in dtype) whose layers decode with the PyTorch step (every `compiled_decode` off)."""
    import copy

    twin = copy.deepcopy(model)
    if dtype is not None:
        twin.to(dtype)
    for m in twin.modules():
        if hasattr(m, "compiled_decode"):
            m.compiled_decode = False
    return twin


def block_decode_twin(model, dtype=None):
    """A copy of `model` (in dtype) that decodes block by block with each layer's compiled block step (the model's
    whole-model step off, the layers' `compiled_decode` as they are)."""
    import copy

    twin = copy.deepcopy(model)
    if dtype is not None:
        twin.to(dtype)
    twin.compiled_decode = False
    return twin


def decode_tokens(model, ids, prefill=4, cache=None):
    """(logits, cache): a prefill of the first `prefill` tokens (its logits for every token), then one token at a
    time; prefill 0 continues `cache` (a new one when None)."""
    with torch.no_grad():
        logits = []
        if prefill:
            out = model(ids[:, :prefill], use_cache=True)
            cache, logits = out.cache, [out.logits]
        elif cache is None:
            cache = model.new_cache()
        for t in range(prefill, ids.shape[1]):
            logits.append(model(ids[:, t:t + 1], cache=cache).logits)
    return torch.cat(logits, 1), cache


# -- quantized weights (tests/quant, tests/cpu/test_qmatvec.py) ----------------------------------------------
def _gamma_fp32(n: int) -> float:
    u = 2.0 ** -24   # fp32 unit roundoff
    return n * u / (1 - n * u)


class StoredWeights:
    """A matrix in a stored format without QuantizedLinear's shape rules (int4's out_features % 16 is torch's
    packing's, not the compiled product's): quantize_weight / pack_int4 as QuantizedLinear stores them."""

    def __init__(self, n, k, mode, group, seed=0, bias=False):
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 3   # rows of different scales
        self.bias = torch.randn(n, generator=g) if bias else None
        self.mode, self.group, self.in_features = mode, group or 0, k
        from linattn.quant.linear import pack_int4, quantize_weight
        self.q, self.scales = quantize_weight(w, mode, group)
        self.stored = self.q if mode == "int8" else pack_int4(self.q)

    def dequantize(self, dtype):
        s = self.scales.to(dtype)
        s = s.unsqueeze(1) if self.mode == "int8" else s.repeat_interleave(self.group, dim=1)
        return self.q.to(dtype) * s


def check_quantized_product(q: "StoredWeights", x, bias=None, add=None):
    """The compiled product of q's stored weights against the fp64 product of its dequantized matrix."""
    from linattn.cpu import decode as cpu_decode
    y = cpu_decode.weight_matvec(x, q.mode, q.stored, q.scales, q.group, bias, add)
    W = q.dequantize(torch.float64)
    x64 = x.double()
    ref = x64 @ W.t()
    mag = x64.abs() @ W.abs().t()
    if bias is not None:
        ref, mag = ref + bias.double(), mag + bias.double().abs()
    if add is not None:
        ref, mag = ref + add.double(), mag + add.double().abs()
    bound = _gamma_fp32(q.in_features + 8) * mag + 2.0 ** -140   # (+ subnormal rounding)
    err = (y.double() - ref).abs()
    assert torch.isfinite(y).all()
    assert (err <= bound).all(), f"{q.mode}: max error {err.max().item():.3g}, bound {bound.min().item():.3g}"
    return y, ref


def rounded_activations_fp64(x):
    """x [B, m] (float32) rounded to int8 per block of 32 inputs, written from the format's definition block by block
    (numpy float32 scalars, independent of quant/linear.round_activations): (x^ = q s in fp64, s per input in fp64).
    s = max|x| / 127 in fp32, raised by ulps until s * 127 >= max; q = round-half-even(x / s) in [-127, 127]."""
    import numpy as np

    xs = x.numpy().astype(np.float32)
    xhat = np.zeros(xs.shape, dtype=np.float64)
    sc = np.zeros(xs.shape, dtype=np.float64)
    for b in range(xs.shape[0]):
        for j0 in range(0, xs.shape[1], 32):
            blk = xs[b, j0:j0 + 32]
            mx = np.float32(np.abs(blk).max())
            s = np.float32(mx / np.float32(127))
            while np.float32(s * np.float32(127)) < mx:
                s = np.nextafter(s, np.float32(np.inf))
            q = np.zeros_like(blk) if s == 0 else np.clip(np.rint(blk / s), -127, 127)
            xhat[b, j0:j0 + 32] = q.astype(np.float64) * np.float64(s)
            sc[b, j0:j0 + 32] = np.float64(s)
    return torch.from_numpy(xhat), torch.from_numpy(sc)


def check_a8_product(q: "StoredWeights", x, bias=None, add=None):
    """The compiled int8-activation product (q's format + "_a8") against fp64: (1) the product of the dequantized
    matrix with x rounded per block (`rounded_activations_fp64`) within gamma_{m+8} sum |w x^| (the integer sums are
    exact; only the fp32 scaling and summation round), (2) the exact product W x within the derived bound
    sum_j |w_j| s_j / 2 + (1)'s."""
    from linattn.cpu import decode as cpu_decode
    y = cpu_decode.weight_matvec(x, q.mode + "_a8", q.stored, q.scales, q.group, bias, add).double()
    W = q.dequantize(torch.float64)
    xhat, s = rounded_activations_fp64(x)
    ref_hat, mag = xhat @ W.t(), xhat.abs() @ W.abs().t()
    ref = x.double() @ W.t()
    for t in (bias, add):
        if t is not None:
            ref_hat, ref, mag = ref_hat + t.double(), ref + t.double(), mag + t.double().abs()
    rounding = _gamma_fp32(q.in_features + 8) * mag + 2.0 ** -140
    assert torch.isfinite(y).all()
    err = (y - ref_hat).abs()
    assert (err <= rounding).all(), f"{q.mode}_a8 vs x^: max error {err.max().item():.3g}"
    assert ((x.double() - xhat).abs() <= s / 2).all()
    bound = (s / 2) @ W.abs().t() + rounding
    err = (y - ref).abs()
    assert (err <= bound).all(), f"{q.mode}_a8 vs x: max error {err.max().item():.3g}"
    return y, ref


#: LINATTN_CACHE_DIR as the session found it (tests.helpers is imported while the tests are collected, before any
#: fixture points the variable elsewhere)
_SESSION_CACHE_DIR = os.environ.get("LINATTN_CACHE_DIR")


def build_decode_variant(tmp, prefix: str):
    """decode.c's variant (`build_variant`)."""
    return build_variant(tmp, "decode", prefix)


def build_variant(tmp, name: str, prefix: str):
    """csrc/<name>.c built from the package's sources with `prefix` put before it (a macro undefined or defined to
    select another code path); the loaded ctypes library. The sources are written into tmp, the library is built
    into the session's kernel cache (`_SESSION_CACHE_DIR`, whatever LINATTN_CACHE_DIR a fixture set meanwhile), keyed
    like every cached library by a hash of its sources — the prefix included —, so a later run or another fixture
    with the same prefix loads it instead of compiling again. immintrin.h is included before the prefix: its
    `#pragma GCC target` sections restore the command line's feature macros when included later, which would undo
    an #undef."""
    import ctypes

    from linattn.cpu import build as cbuild
    src = tmp / "src"
    src.mkdir()
    for f in cbuild.CSRC.iterdir():
        if f.is_file():
            (src / f.name).write_bytes(f.read_bytes())
    first = "#if defined(__x86_64__) || defined(__i386__)\n#include <immintrin.h>\n#endif\n"
    (src / f"{name}.c").write_text(first + prefix + (cbuild.CSRC / f"{name}.c").read_text())
    with _session_cache():
        return ctypes.CDLL(str(cbuild.build(name, src)))


def fixture_executable(name: str, flag_options, args) -> "Path | None":
    """tests/fixtures/cpu/<name>.c built with `args` and the first of `flag_options` (alternatives, e.g. with and
    without -march=native) that compiles, into the kernel cache, in a folder keyed by a hash of what the executable
    is made of (the harness, csrc/'s files, the compiler and its version, the flags, the CPU: `linattn.cpu.build`'s
    own compiler and machine descriptions), so a later run reuses it as it does the libraries; written under another
    name and renamed into place (a crash leaves no half file). None when no option builds; skips without a
    compiler."""
    import hashlib
    import subprocess

    import pytest

    from linattn.cpu import build as cbuild
    harness = Path(__file__).resolve().parent / "fixtures" / "cpu" / f"{name}.c"
    cc = cbuild.compiler()
    version = cbuild._compiler_version(tuple(cc))
    if version is None:
        pytest.skip("no C compiler")
    for flags in flag_options:
        cmd = [*cc, *args, *flags, f"-I{cbuild.CSRC}"]
        h = hashlib.sha256()
        for part in (harness.read_bytes(), *(f.read_bytes() for f in sorted(cbuild.CSRC.iterdir()) if f.is_file()),
                     " ".join(cmd).encode(), version.encode(), cbuild._machine().encode()):
            h.update(part + b"\0")
        folder = cbuild.cache_root() / "harness" / h.hexdigest()[:20]
        exe = folder / name
        if exe.is_file():
            return exe
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = folder / f".{name}.{os.getpid()}"
        if subprocess.run([*cmd, str(harness), "-o", str(tmp), "-lm"], capture_output=True).returncode == 0:
            os.replace(tmp, exe)
            return exe
        tmp.unlink(missing_ok=True)
    return None


@contextlib.contextmanager
def _session_cache():
    """LINATTN_CACHE_DIR as the session found it, for the duration of the block."""
    before = os.environ.get("LINATTN_CACHE_DIR")
    try:
        if _SESSION_CACHE_DIR is None:
            os.environ.pop("LINATTN_CACHE_DIR", None)
        else:
            os.environ["LINATTN_CACHE_DIR"] = _SESSION_CACHE_DIR
        yield
    finally:
        if before is None:
            os.environ.pop("LINATTN_CACHE_DIR", None)
        else:
            os.environ["LINATTN_CACHE_DIR"] = before


def check_product_threads(q: "StoredWeights", x, check=None):
    """q's compiled product (with its bias) at 1 and at 2 threads: the same bits, each within its fp64 bound as
    `check` asserts it (default `check_quantized_product`; `check_a8_product` for int8 activations)."""
    check = check or check_quantized_product
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        y1, _ = check(q, x, bias=q.bias)
        torch.set_num_threads(2)
        y2, _ = check(q, x, bias=q.bias)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(y1, y2)


def dequantized_fp64(qmodel):
    """qmodel with every QuantizedLinear replaced by an fp64 nn.Linear of its dequantized weight (exact)."""
    import copy

    from torch import nn

    from linattn.quant import quantized_modules

    ref = copy.deepcopy(qmodel)
    for name, q in quantized_modules(ref).items():
        lin = nn.Linear(q.in_features, q.out_features, bias=q.bias is not None)
        with torch.no_grad():
            lin.weight = nn.Parameter(q.dequantize(torch.float64))
            if q.bias is not None:
                lin.bias = nn.Parameter(q.bias.double())
        parent, _, attr = name.rpartition(".")
        setattr(ref.get_submodule(parent) if parent else ref, attr, lin)
    return ref.double()


def cpu_flags() -> set:
    """This machine's CPU feature flags (/proc/cpuinfo; empty where it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


#: `vpdpbusd` (AVX-VNNI) in plain C: an int32 lane plus its 4 unsigned bytes times the 4 signed ones
VPDPBUSD_IN_C = r"""
#ifndef A8_TEST_DPBUSD
#define A8_TEST_DPBUSD
#include <stdint.h>
#include <string.h>
static inline __m256i test_dpbusd(__m256i src, __m256i a, __m256i b) {
    uint8_t ua[32];
    int8_t sb[32];
    int32_t s[8];
    memcpy(ua, &a, 32), memcpy(sb, &b, 32), memcpy(s, &src, 32);
    for (int i = 0; i < 8; ++i)
        for (int k = 0; k < 4; ++k) s[i] += (int32_t)ua[4 * i + k] * (int32_t)sb[4 * i + k];
    memcpy(&src, s, 32);
    return src;
}
#define _mm256_dpbusd_avx_epi32(src, a, b) test_dpbusd(src, a, b)
#endif
"""
