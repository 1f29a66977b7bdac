"""The softmax kind's scores in the compiled decode (csrc/decode.c `kv_scores`, through the test entry point
`linattn_decode_kv_scores`) on every code path: the native build (AVX2 on a machine without AVX-512: each 64-byte
line as two 8-lane halves in registers, `KV_SCORES_YMM` / `vsum_ymm`), AVX2 on an AVX-512 machine (its macro removed)
and LINATTN_PLAIN_C (GCC's generic 16-lane vector code, the reference the intrinsics must reproduce). Each against
the fp64 scores of the keys as stored (bf16: their rounded values, exact in fp64) within the computed bound, and the
vector paths to the generic path's bits (fp32 and bf16 keys): head dims on and off the vector path (a multiple of
16, or not), contexts of 1 to 9 keys (the four-key steps and the single-key tail), rows strided as in a GQA cache,
NaN / inf / huge values in q or k. A lane summed out of its order (the pairwise vsum, the halves' fmas) fails: the
bits differ on random data. Then a KV group's query heads together (`kv_scores_heads`, `kv_axpy_heads`: four heads a
pass over the keys on AVX2, the value rows once for the group) against the other paths and against the one head a
thread of the 2-thread step, to the bit, and against the fp64 path within its bound."""
from __future__ import annotations

import math

import pytest
import torch

from linattn.cpu import bindings, decode as cpu_decode, ptr
from tests.helpers import _gamma_fp32, build_decode_variant, cpu_flags

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler: the compiled kernels are off")

PATHS = {
    "native": (None, set()),
    "avx2": ("#undef __AVX512F__\n", {"avx2", "fma"}),
    "plain_c": ("#define LINATTN_PLAIN_C\n", set()),
}


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    """{path: the decode library bound from its table} for the paths this machine runs (avx2: only where AVX-512
    would otherwise be taken; on an AVX2 machine the native build is that path)."""
    out = {}
    for name, (prefix, needs) in PATHS.items():
        if not needs <= cpu_flags() or (name == "avx2" and "avx512f" not in cpu_flags()):
            continue
        if prefix is None:
            out[name] = bindings.bind("decode")
            continue
        tmp = tmp_path_factory.mktemp(name)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("LINATTN_CACHE_DIR", str(tmp / "cache"))
            out[name] = bindings.Bound("decode", build_decode_variant(tmp, prefix))
    return out


def _scores(lib, keys, q, first, stride, nt, D, scale):
    """w [nt] from lib's kv_scores: keys the flat cache (float32 / float64 / bfloat16), q [D]"""
    real = torch.float64 if q.dtype == torch.float64 else torch.float32
    w = torch.full((nt,), float("nan"), dtype=real)
    lib("linattn_decode_kv_scores", real, int(keys.dtype == torch.bfloat16), ptr(keys), first, stride, nt, D, ptr(q),
        scale, ptr(w))
    return w


def _case(dtype, D, nt, G=2, seed=0):
    """a cache of nt + 2 rows of G key heads of D (dtype) and one query (its plan's type); the scores read head 1 from
    row 1 on (first, stride as softmax_mix passes them)"""
    g = torch.Generator().manual_seed(seed)
    keys = (torch.randn(nt + 2, G, D, generator=g) * (torch.rand(nt + 2, G, 1, generator=g) * 3 + 0.1)).to(dtype)
    q = torch.randn(D, generator=g).to(torch.float64 if dtype == torch.float64 else torch.float32)
    return keys.reshape(-1).contiguous(), q, (1 * G + 1) * D, G * D


def _ref(keys, q, first, stride, nt, D, scale):
    k = torch.stack([keys[first + t * stride:first + t * stride + D] for t in range(nt)]).double()
    q64 = q.double()
    return (k @ q64) * scale, (k.abs() @ q64.abs()) * abs(scale)


def _bits(w):
    return w.view(torch.int64 if w.dtype == torch.float64 else torch.int32)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


@pytest.mark.parametrize("kind", sorted(DTYPES))
@pytest.mark.parametrize("D", [16, 32, 256, 24, 40, 8])
def test_scores_against_fp64_on_every_path(libs, kind, D):
    """Every path's scores within gamma(D + 1) sum |q_i k_i| |scale| of the fp64 scores, every context 1-9 and 72."""
    dtype = DTYPES[kind]
    for nt in list(range(1, 10)) + [72]:
        keys, q, first, stride = _case(dtype, D, nt, seed=nt + D)
        ref, mag = _ref(keys, q, first, stride, nt, D, 0.0625)
        gamma = (D + 1) * 2.0 ** -53 if dtype == torch.float64 else _gamma_fp32(D + 1)
        for name, lib in libs.items():
            w = _scores(lib, keys, q, first, stride, nt, D, 0.0625)
            err = (w.double() - ref).abs()
            assert (err <= gamma * mag + 2.0 ** -140).all(), f"{name} {kind} D={D} nt={nt}: {err.max().item():.3g}"


@pytest.mark.parametrize("kind", ["fp32", "bf16"])
@pytest.mark.parametrize("D", [16, 48, 256])
def test_vector_paths_reproduce_the_generic_bits(libs, kind, D):
    """On the vector path (D a multiple of 16), every path's scores are the generic 16-lane code's to the bit, at every
    context 1-9 (four-key steps and the tail) and 72, and at a scale that is not a power of two."""
    if "plain_c" not in libs:
        pytest.skip("no generic build")
    dtype = DTYPES[kind]
    for nt in list(range(1, 10)) + [72]:
        keys, q, first, stride = _case(dtype, D, nt, seed=100 + nt)
        want = _scores(libs["plain_c"], keys, q, first, stride, nt, D, 1 / math.sqrt(D + 3))
        for name, lib in libs.items():
            got = _scores(lib, keys, q, first, stride, nt, D, 1 / math.sqrt(D + 3))
            assert torch.equal(_bits(got), _bits(want)), f"{name} {kind} D={D} nt={nt}"


@pytest.mark.parametrize("kind", ["fp32", "bf16", "fp64"])
def test_hostile_inputs_match_the_generic_path(libs, kind):
    """NaN, inf and values whose products overflow, in q or in one key: the same bits (NaN for NaN) on every path,
    and where the fp64 score is finite and in range, within the bound."""
    dtype, D, nt = DTYPES[kind], 32 if kind != "fp64" else 16, 7
    big = 3e38 if dtype != torch.float64 else 1e308
    for where, val in [("q", float("nan")), ("q", float("inf")), ("k", float("-inf")), ("k", float("nan")),
                       ("q", big), ("k", big), ("q", 0.0)]:
        keys, q, first, stride = _case(dtype, D, nt, seed=3)
        if where == "q":
            q[5] = val
        else:
            keys[first + 2 * stride + 9] = val   # key 2's element 9
        ws = {name: _scores(lib, keys, q, first, stride, nt, D, 0.125) for name, lib in libs.items()}
        want = ws.get("plain_c", ws["native"])
        for name, w in ws.items():
            assert torch.equal(torch.isnan(w), torch.isnan(want)), f"{name} {where}={val}"
            assert torch.equal(w.nan_to_num(0.0, 1.0, -1.0), want.nan_to_num(0.0, 1.0, -1.0)), f"{name} {where}={val}"
        ref, mag = _ref(keys, q, first, stride, nt, D, 0.125)
        ok = torch.isfinite(mag) & (mag < 1e30)
        err = (ws["native"].double() - ref).abs()
        assert (err[ok] <= _gamma_fp32(D + 1) * mag[ok] + 2.0 ** -140).all()
        if where == "q" and val != val:
            assert torch.isnan(ws["native"]).all()


def _softmax_model(dtype, **kw):
    """Gated DeltaNet then gated softmax attention (4 query / 2 KV heads of 32: the scores' vector path), seeded,
    norms and biases moved off their initial values."""
    from linattn.models import LanguageModel, LMConfig

    torch.manual_seed(0)
    att = dict(heads=4, n_kv_heads=2, head_dim=32, output_gate=True, kv_chunk=4)
    att.update(kw)
    cfg = LMConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=2, head_dim=16, ffn_hidden=48,
                   mixer=["gated-deltanet", "softmax"], mixer_kwargs={"softmax": att})
    model = LanguageModel(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n or "A_log" in n:
                p.add_(0.1 * torch.randn_like(p))
            if "q_proj" in n or "k_proj" in n:
                p.mul_(3.0)
    return model.to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate", ["silu", "sigmoid"])
def test_whole_model_decode_bits_on_every_path(libs, dtype, gate, monkeypatch):
    """The compiled whole-model decode of a hybrid with a softmax layer (bf16: bf16 weights and KV cache) gives the
    same logits and KV cache on every path, to the bit, over contexts of 1 to 10 keys (batch 2)."""
    from tests.models.decode_kinds import decode

    ids = torch.randint(0, 61, (2, 10), generator=torch.Generator().manual_seed(5))
    got = {}
    for name, lib in libs.items():
        monkeypatch.setattr(bindings, "load_library", lambda n, lib=lib: lib.lib if n == "decode" else None)
        model = _softmax_model(dtype, gate_act=gate)
        logits, cache = decode(model, ids, 1)
        kv = cache.layer(1, "mixer").kv
        assert kv.length == ids.shape[1] and kv.k.shape[1] >= kv.length   # ([B, capacity, kv heads, D])
        got[name] = (logits, kv.k[:, :kv.length].clone(), kv.v[:, :kv.length].clone())
    want = got.get("plain_c", got["native"])
    for name, (logits, k, v) in got.items():
        assert torch.equal(logits, want[0]) and torch.equal(k, want[1]) and torch.equal(v, want[2]), name


def _decode_kv(model, ids, prefill=1):
    from tests.models.decode_kinds import decode

    logits, cache = decode(model, ids, prefill)
    kv = cache.layer(1, "mixer").kv
    return logits, kv.k[:, :kv.length].clone(), kv.v[:, :kv.length].clone()


#: (query heads, KV heads, head dim): groups of 4 (the AVX2 path's four heads a pass over the keys), of 6 (four and a
#: tail of two), of 1, and a head dim off the scores' vector path
GROUPS = [(8, 2, 32), (6, 1, 32), (3, 3, 16), (8, 2, 24)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", GROUPS)
@pytest.mark.parametrize("B", [1, 2])
def test_grouped_heads_give_the_same_bits_on_every_path(libs, dtype, heads, B, monkeypatch):
    """A KV group's query heads scored and mixed together (one pass over the group's key and value rows at one
    thread: `kv_scores_heads`, `kv_axpy_heads`) give the same logits and KV cache on every path, to the bit, over
    contexts of 1 to 9 keys, batch 1 and 2, sigmoid gate (the SiLU gate: the test above)."""
    H, G, D = heads
    ids = torch.randint(0, 61, (B, 9), generator=torch.Generator().manual_seed(H + G + D))
    got = {}
    for name, lib in libs.items():
        monkeypatch.setattr(bindings, "load_library", lambda n, lib=lib: lib.lib if n == "decode" else None)
        got[name] = _decode_kv(_softmax_model(dtype, heads=H, n_kv_heads=G, head_dim=D, gate_act="sigmoid"), ids)
    want = got.get("plain_c", got["native"])
    for name, out in got.items():
        assert all(torch.equal(a, b) for a, b in zip(out, want)), name


def test_grouped_heads_within_the_fp64_bound():
    """The grouped heads' logits (fp32, groups of 4) within the bound of the fp64 per-block PyTorch path."""
    from tests.models.decode_kinds import assert_within_bound, decode, pytorch_twin

    model = _softmax_model(torch.float32, heads=8, n_kv_heads=2, head_dim=32)
    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(4))
    got = _decode_kv(model, ids)[0]
    ref64 = decode(pytorch_twin(model, torch.float64), ids, 1)[0]
    twin_err = (decode(pytorch_twin(model), ids, 1)[0].double() - ref64).abs().max().item()
    assert_within_bound(got, ref64, twin_err, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_heads_match_the_per_head_threads(dtype):
    """At one thread a KV group's heads go together; at two, past softmax_mix's threshold (PAR_MIN_ELEMS: here from
    128 keys on), one head a thread as before: the same logits and KV cache, to the bit."""
    ids = torch.randint(0, 61, (2, 131), generator=torch.Generator().manual_seed(9))
    got = []
    for threads in (1, 2):
        torch.set_num_threads(threads)   # (put back after the test by tests/conftest.py)
        got.append(_decode_kv(_softmax_model(dtype, heads=8, n_kv_heads=2, head_dim=32), ids, prefill=126))
    assert all(torch.equal(a, b) for a, b in zip(*got))
