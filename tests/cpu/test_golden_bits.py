"""Golden bits of the compiled CPU kernels: every entry point of csrc/ (both dtypes, forward and backward, decode's
four steps included) run on seeded inputs at 1 and 2 threads, each output hashed (SHA-256 of its bytes) and compared
with the hashes recorded in tests/fixtures/cpu/golden_bits.json. A restyle of the C sources must leave every bit
as it was (or say which changed and why, and record the new hashes).

`-march=native` code and another compiler round differently, so the recorded hashes are keyed by the compiler's
version and the CPU's model and feature flags (`build._machine`); on another machine or compiler the test skips and
says so. Record this machine's hashes with

    PYTHONPATH=src python -m tests.cpu.test_golden_bits --write

(that adds or replaces this machine's entry and leaves the others).
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import sys
from pathlib import Path
from typing import Callable, Dict, List

import pytest
import torch

from linattn.cpu import build as cbuild

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "cpu" / "golden_bits.json"
THREADS = (1, 2)
DTYPES = {"f32": torch.float32, "f64": torch.float64}


def machine_key() -> str:
    """The compiler's version and this CPU's model and flags, hashed (what `-march=native` code depends on)."""
    version = cbuild._compiler_version(tuple(cbuild.compiler())) or "no compiler"
    return version + " | cpu " + hashlib.sha256(cbuild._machine().encode()).hexdigest()[:16]


def _digest(*tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        if t is None:
            h.update(b"none")
            continue
        t = t.detach().contiguous()
        h.update(str(tuple(t.shape)).encode() + str(t.dtype).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:24]


def _rand(gen, *shape, dtype, scale=1.0, grad=False):
    x = (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)
    return x.requires_grad_(grad)


def _grads(out, inputs, gen):
    """Gradients of sum(out_i * seeded cotangent_i) with respect to the inputs that require them."""
    outs = [o for o in out if o is not None and o.requires_grad]
    cot = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype) for o in outs]
    want = [x for x in inputs if x is not None and x.requires_grad]
    return torch.autograd.grad(outs, want, cot, allow_unused=True)


# ------------------------------------------------------------------------------------------ the cases, one per call


def _linear(dtype, gen) -> List[str]:
    from linattn.cpu import linear

    out = []
    TT, H, K, V = 37, 2, 8, 6
    starts = [0, 1, 20, 37]
    for fmap in (None, "relu", "elu+1"):
        for gate in (False, True):
            for norm in (False, True):
                q = _rand(gen, TT, H, K, dtype=dtype, scale=3.0, grad=True)
                k = _rand(gen, TT, H, K, dtype=dtype, scale=3.0, grad=True)
                v = _rand(gen, TT, H, V, dtype=dtype, grad=True)
                g = -torch.rand(TT, H, generator=gen, dtype=torch.float64).to(dtype) if gate else None
                if g is not None:
                    g.requires_grad_()
                S0 = _rand(gen, 3, H, K, V + int(norm), dtype=dtype, scale=0.1, grad=True)
                if fmap is None and norm:  # linear-space features for the normaliser: non-negative
                    q = q.detach().abs().requires_grad_()
                    k = k.detach().abs().requires_grad_()
                    S0 = S0.detach().abs().requires_grad_()
                num, den, S, *_ = linear.chunk_linear_attention(q, k, v, g, S0, starts=starts, chunk_size=16,
                                                               norm=norm, fmap=fmap, scale=0.5,
                                                               eps=1e-6 if norm else None)
                grads = _grads((num, den, S), (q, k, v, g, S0), gen)
                out.append(_digest(num, den, S, *grads))
    # chunk-start states and the no-grad path with huge and tiny inputs (exp clamps, elu+1 on -inf .. 0)
    q = torch.cat([_rand(gen, 20, H, K, dtype=dtype, scale=40.0), torch.full((1, H, K), -float("inf"), dtype=dtype)])
    k = _rand(gen, 21, H, K, dtype=dtype, scale=40.0)
    v = _rand(gen, 21, H, V, dtype=dtype)
    g = -torch.rand(21, H, generator=gen, dtype=torch.float64).to(dtype) * 60
    for fmap in ("elu+1", "relu"):
        num, den, S, *_ = linear.chunk_linear_attention(q, k, v, g, None, starts=[0, 21], chunk_size=5, norm=True,
                                                       fmap=fmap, scale=1.0, eps=None)
        out.append(_digest(num, den, S))
    return out


def _delta(dtype, gen) -> List[str]:
    from linattn.cpu import delta

    out = []
    TT, H, K, V = 150, 2, 8, 40  # 150 > 2 checkpoints; V = 40 is one full column block and a partial one in f64
    starts = [0, 1, 70, 150]
    for gate in ("none", "head", "channel"):
        q = _rand(gen, TT, H, K, dtype=dtype, scale=0.3, grad=True)
        k = torch.nn.functional.normalize(_rand(gen, TT, H, K, dtype=dtype), dim=-1).requires_grad_()
        v = _rand(gen, TT, H, V, dtype=dtype, grad=True)
        a = torch.rand(TT, H, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
        shape = {"none": None, "head": (TT, H), "channel": (TT, H, K)}[gate]
        g = None if shape is None else (-0.1 * torch.rand(*shape, generator=gen, dtype=torch.float64)).to(dtype)
        if g is not None:
            g.requires_grad_()
        S0 = _rand(gen, 3, H, K, V, dtype=dtype, scale=0.1, grad=True)
        o, S = delta.delta_scan(q, k, v, a, g, S0, starts)
        grads = _grads((o, S), (q, k, v, a, g, S0), gen)
        out.append(_digest(o, S, *grads))
        with torch.no_grad():
            out.append(_digest(*delta.delta_scan(q, k, v, a, g, None, starts)))
    return out


def _deltaprep(dtype, gen) -> List[str]:
    from linattn.cpu import delta

    out = []
    B, T, H, K, V = 2, 5, 3, 8, 6
    q = _rand(gen, B, T, H, K, dtype=dtype, grad=True)
    k = _rand(gen, B, T, H, K, dtype=dtype, grad=True)
    with torch.no_grad():
        k[0, 0, 0] *= 1e30 if dtype == torch.float32 else 1e200  # the overflow-safe rows
        k[0, 1, 0] *= 1e-30
    v = _rand(gen, B, T, H, V, dtype=dtype, grad=True)
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    res = delta.delta_prepare(q, k, v, beta, 0.3, 1e-6)
    out.append(_digest(*res, *_grads(res, (q, k, v, beta), gen)))
    res = delta.delta_prepare_raw(q, k, v, 0.3)
    out.append(_digest(*res, *_grads(res[:3], (q, k, v), gen)))
    y = delta.l2_rows(k, 1e-6)
    out.append(_digest(y, *_grads((y,), (k,), gen)))
    return out


def _conv(dtype, gen) -> List[str]:
    from linattn.cpu import conv

    out = []
    B, T, D, K = 2, 9, 20, 4
    for silu in (False, True):
        xp = _rand(gen, B, T + K - 1, D, dtype=dtype, scale=5.0, grad=True)
        w = _rand(gen, K, D, dtype=dtype, grad=True)
        b = _rand(gen, D, dtype=dtype, grad=True)
        y = conv.short_conv(xp, w, b, silu)
        out.append(_digest(y, *_grads((y,), (xp, w, b), gen)))
        x = _rand(gen, B, T, D, dtype=dtype, scale=5.0, grad=True)
        past = _rand(gen, B, K - 1, D, dtype=dtype, grad=True)
        y = conv.short_conv_sep(x, past, w, b, silu)
        out.append(_digest(y, *_grads((y,), (x, past, w, b), gen)))
        y = conv.short_conv_sep(x, None, w, None, silu)
        out.append(_digest(y, *_grads((y,), (x, w), gen)))
    return out


def _gatednorm(dtype, gen) -> List[str]:
    from linattn.cpu import gatednorm

    out = []
    x = _rand(gen, 7, 24, dtype=dtype, scale=3.0, grad=True)
    gate = _rand(gen, 7, 24, dtype=dtype, scale=5.0, grad=True)
    w = _rand(gen, 24, dtype=dtype, grad=True)
    y = gatednorm._GatedRMSNorm.apply(x, gate, w, 1e-5)
    out.append(_digest(y, *_grads((y,), (x, gate, w), gen)))
    y = gatednorm._GatedRMSNorm.apply(x, None, None, 1e-5)
    out.append(_digest(y, *_grads((y,), (x,), gen)))
    return out


def _decode(dtype, gen) -> List[str]:
    """decode.c's four entry points through the layers and models that call them (their bindings may change)."""
    from linattn.layers import LayerCache
    from linattn.models import LanguageModel, LMConfig
    from tests.helpers import perturbed_mixer

    out = []
    for name, kw in (("gated-deltanet", {}), ("efla", {}), ("linear-elu+1", dict(gate="scalar")),
                     ("linear-relu", dict(short_conv=True, output_gate=True))):
        layer = perturbed_mixer(name, 32, 2, dtype, **kw)
        x = _rand(gen, 2, 6, 32, dtype=dtype)
        cache, ys = LayerCache(), []
        with torch.no_grad():
            for t in range(x.shape[1]):
                ys.append(layer(x[:, t:t + 1], cache=cache))
        out.append(_digest(*ys))
    for mixer in ("gated-deltanet", "linear-elu+1"):
        for whole_model in (False, True):
            torch.manual_seed(0)
            model = LanguageModel(LMConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=2, mixer=mixer)).to(dtype)
            model.compiled_decode = whole_model
            model.eval()
            ids = torch.randint(0, 50, (2, 6), generator=gen)
            logits = []
            with torch.no_grad():
                cache = model.new_cache()
                for t in range(ids.shape[1]):
                    logits.append(model(ids[:, t:t + 1], cache=cache).logits)
            out.append(_digest(*logits))
    return out


def _probe(dtype, gen) -> List[str]:
    if dtype != torch.float32:
        return []
    lib = cbuild.load_library("probe")
    x, y = _rand(gen, 37, dtype=dtype), _rand(gen, 37, dtype=dtype)
    lib.linattn_probe_axpy.argtypes = [ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p]
    lib.linattn_probe_axpy(37, 0.75, x.data_ptr(), y.data_ptr())
    return [_digest(y)]


LIBRARIES: Dict[str, Callable] = {"probe": _probe, "linear": _linear, "delta": _delta, "deltaprep": _deltaprep,
                                  "conv": _conv, "gatednorm": _gatednorm, "decode": _decode}


def compute(library: str) -> Dict[str, List[str]]:
    """{"<dtype>/t<threads>": [hash per case]} for one library."""
    saved = torch.get_num_threads()
    res = {}
    try:
        for sfx, dtype in DTYPES.items():
            for n in THREADS:
                torch.set_num_threads(n)
                res[f"{sfx}/t{n}"] = LIBRARIES[library](dtype, torch.Generator().manual_seed(53))
    finally:
        torch.set_num_threads(saved)
    return res


def _recorded():
    return json.loads(FIXTURE.read_text()) if FIXTURE.exists() else {}


@pytest.mark.parametrize("library", list(LIBRARIES))
def test_golden_bits(library):
    if cbuild.load_library(library) is None:
        pytest.skip("no C compiler: the compiled kernels are off")
    key = machine_key()
    recorded = _recorded().get(key)
    if recorded is None:
        pytest.skip(f"no golden hashes for this compiler and CPU ({key}): -march=native and another compiler "
                    "change bits; record them with `python -m tests.cpu.test_golden_bits --write`")
    got = compute(library)
    assert got == recorded[library], f"{library}: the outputs' bits changed"


def test_thread_counts_give_the_same_bits():
    """Every kernel gives the same bits at 1 and 2 threads (the recorded hashes then agree too)."""
    if cbuild.load_library("linear") is None:
        pytest.skip("no C compiler: the compiled kernels are off")
    for library in ("linear", "delta", "deltaprep", "conv", "gatednorm"):
        got = compute(library)
        for sfx in DTYPES:
            assert got[f"{sfx}/t1"] == got[f"{sfx}/t2"], (library, sfx)


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m tests.cpu.test_golden_bits --write")
    table = _recorded()
    table[machine_key()] = {name: compute(name) for name in LIBRARIES}
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"recorded {FIXTURE} for {machine_key()}")
