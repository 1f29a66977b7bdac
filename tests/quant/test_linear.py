"""QuantizedLinear against plain references written from the formulas: every weight within half its scale of the
original, every output within the bound that follows (sum_k |x_k| s_nk / 2 for the weights, plus the rounding of
the path that ran, computed per output), against a dequantized fp64 reference; refusals with clear errors."""
import io

import pytest
import torch
from torch import nn

from linattn.errors import LinattnError
from linattn.quant import QuantizedLinear, linear as qlinear
from linattn.quant.linear import PACKED_MAX_ROWS, PACKED_MAX_ROWS_NO_BF16, pack_int4, product_path, unpack_int4

U32 = 2.0 ** -24      # unit roundoff of fp32
UB = 2.0 ** -8        # unit roundoff of bf16
FORMATS = [("int8", None), ("int4", 32), ("int4", 64)]


def _weights(N, K, seed=0):
    """A weight with awkward rows: ordinary, huge, tiny, all-zero, one outlier."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.05
    w[1] *= 1e4
    w[2] *= 1e-20
    w[3] = 0.0
    w[4, 5] = 3.0
    return w


def _scales_per_weight(layer: QuantizedLinear) -> torch.Tensor:
    return layer.expanded_scales().double()


@pytest.mark.parametrize("mode, group", FORMATS)
def test_every_weight_within_half_its_scale(mode, group):
    w = _weights(32, 128)
    layer = QuantizedLinear.from_weight(w, None, mode, group)
    deq, s = layer.dequantize(torch.float64), _scales_per_weight(layer)
    assert torch.all((w.double() - deq).abs() <= s / 2)
    q = layer.int_weight()
    qmax = 127 if mode == "int8" else 7
    assert int(q.abs().max()) <= qmax
    # the scale is the smallest bf16 value >= max|w| / qmax of its row or group (no weight is clipped)
    amax = w.double().abs().view(32, -1, 128 if mode == "int8" else group).amax(-1).view(layer.scales.shape)
    assert torch.all(layer.scales.double() >= amax / qmax)
    assert torch.all(layer.scales.double() <= torch.clamp(amax / qmax, min=torch.finfo(torch.bfloat16).tiny)
                     * (1 + 2 * UB))


def test_int4_nibbles_round_trip():
    q = torch.randint(-8, 8, (16, 64), dtype=torch.int8)
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (16, 32)
    assert torch.equal(packed[:, 0] & 15, (q[:, 0] + 8).to(torch.uint8))      # even column: the low nibble
    assert torch.equal(unpack_int4(packed), q)


def _bounds(layer: QuantizedLinear, x: torch.Tensor, w: torch.Tensor, bias):
    """(bound vs the dequantized weight, bound vs the original weight) per output, fp64 `[M, N]`.

    Rounding of the path that ran: bf16 compute rounds x to bf16 (u_b |x|), may round the dequantized weight to
    bf16 (u_b |w|, the prefill path), accumulates in fp32 (gamma_K = K u_32 per product sum) and rounds the
    output to bf16 (u_b |y|); fp32 compute only accumulates and rounds in the compute dtype. The product terms
    of these small factors are covered by the (1 + ...) factors."""
    M, K = x.shape
    xd, deq = x.double(), layer.dequantize(torch.float64)
    S = xd.abs() @ deq.abs().T                                     # sum_k |x_k| |w_nk|
    y = xd @ deq.T + (bias.double() if bias is not None else 0.0)
    b = bias.double().abs() if bias is not None else 0.0
    out_u = torch.finfo(x.dtype).eps / 2 if x.dtype != torch.float64 else 0.0
    if layer.compute == "bf16":
        rnd = (2 * UB + (K + 4) * U32) * S * (1 + 3 * UB) + (UB + 2 * U32) * (y.abs() + b + 3 * UB * S)
    else:
        u = 2.0 ** -53 if x.dtype == torch.float64 else U32
        rnd = (K + 4) * u * (S + b) + out_u * (y.abs() + (K + 4) * u * (S + b))
    quant = xd.abs() @ (_scales_per_weight(layer) / 2).T          # sum_k |x_k| s_nk / 2
    return y, rnd, quant


def _capability(monkeypatch, bf16_instructions: bool, block_rows: int = 32, K: int = 192):
    """Pretend the CPU has (or lacks) bf16 instructions; the fp32 path dequantizes block_rows rows at a time (so
    that 48 rows take a whole block and a partial one)."""
    monkeypatch.setattr(qlinear, "native_bf16", lambda: bf16_instructions)
    monkeypatch.setattr(qlinear, "PREFILL_BLOCK_WEIGHTS", block_rows * K)


THRESHOLDS = sorted({*PACKED_MAX_ROWS.values(), *PACKED_MAX_ROWS_NO_BF16.values()})


@pytest.mark.parametrize("mode, group", FORMATS)
@pytest.mark.parametrize("compute", ["bf16", "fp32"])
@pytest.mark.parametrize("rows", [1, 3, *THRESHOLDS, *(n - 1 for n in THRESHOLDS), *(n + 1 for n in THRESHOLDS)])
@pytest.mark.parametrize("bf16_instructions, compiled", [(True, True), (False, True), (False, False)])
def test_outputs_within_the_computed_bound(mode, group, compute, rows, bf16_instructions, compiled, monkeypatch):
    """Every path on both sides of every threshold; the CPU without bf16 instructions with the compiled
    dequantizer (cpu/dequant.py) and with torch's fallback."""
    N, K = 48, 192
    _capability(monkeypatch, bf16_instructions)
    if not compiled:
        monkeypatch.setattr(qlinear.cpu_dequant, "available", lambda: False)
    w, bias = _weights(N, K, seed=rows), torch.randn(N) * 0.1
    layer = QuantizedLinear.from_weight(w, bias, mode, group, compute, activations="float")
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(1)) * 3
    x[0, :7] *= 1e3                                             # a row with large inputs
    with torch.no_grad():
        out = layer(x)
    assert out.dtype == torch.float32 and out.shape == (rows, N)
    y_deq, rnd, quant = _bounds(layer, x, w, bias)
    err = (out.double() - y_deq).abs()
    assert torch.all(err <= rnd), f"max excess {(err - rnd).max().item()}"
    y_orig = x.double() @ w.double().T + bias.double()
    assert torch.all((out.double() - y_orig).abs() <= quant + rnd)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bf16_instructions", [True, False])
@pytest.mark.parametrize("T", [5, 101])   # (101: the many-rows path of both modes)
def test_other_activation_dtypes(dtype, bf16_instructions, T, monkeypatch):
    _capability(monkeypatch, bf16_instructions, K=64)
    w = _weights(32, 64)
    for mode, group in FORMATS:
        for compute in ("bf16", "fp32"):
            layer = QuantizedLinear.from_weight(w, torch.randn(32), mode, group, compute, activations="float")
            x = torch.randn(2, T, 64, dtype=dtype)
            out = layer(x)
            assert out.dtype == dtype and out.shape == (2, T, 32)
            y, rnd, _ = _bounds(layer, x.reshape(-1, 64), w, layer.bias)
            assert torch.all((out.reshape(-1, 32).double() - y).abs() <= rnd)


@pytest.mark.parametrize("bf16_instructions", [True, False])
@pytest.mark.parametrize("rows", [3, 200])
def test_shapes_empty_rows_and_nan_rows(bf16_instructions, rows, monkeypatch):
    _capability(monkeypatch, bf16_instructions, K=32)
    for mode, group in FORMATS[:2]:
        layer = QuantizedLinear.from_weight(_weights(48, 64)[:, :32], torch.zeros(48), mode, group)
        assert layer(torch.randn(0, 32)).shape == (0, 48)
        assert layer(torch.randn(2, 0, 32)).shape == (2, 0, 48)
        assert layer(torch.randn(1, 1, 32)).shape == (1, 1, 48)
        x = torch.randn(rows, 32)
        x[1, 4] = float("nan")
        out = layer(x)
        assert torch.isnan(out[1]).all() and torch.isfinite(out[[0, 2]]).all()   # a NaN stays in its row


# --------------------------------------------------------------------------- the path by the CPU's capability

@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_the_path_by_capability_and_rows(mode):
    for rows in (1, 2, PACKED_MAX_ROWS[mode], PACKED_MAX_ROWS[mode] + 1, 4096):
        assert product_path(mode, rows, True) == ("packed" if rows <= PACKED_MAX_ROWS[mode] else "bf16")
    for rows in (1, 2, PACKED_MAX_ROWS_NO_BF16[mode], PACKED_MAX_ROWS_NO_BF16[mode] + 1, 4096):
        assert product_path(mode, rows, False) == ("packed" if rows <= PACKED_MAX_ROWS_NO_BF16[mode] else "fp32")


@pytest.mark.parametrize("caps, native", [
    ({"avx2": True, "avx512_bf16": False, "amx_bf16": False}, False),   # this project's AMD Zen 3
    ({"avx2": True, "avx512_f": True, "avx512_bf16": True, "amx_bf16": False}, True),
    ({"avx2": True, "avx512_bf16": False, "amx_bf16": True, "amx_tile": True}, True),
    ({"avx512_f": True, "avx512_bw": True, "avx512_vnni": True}, False),   # AVX-512 without its bf16 extension
    ({}, False),                                                          # a CPU torch's probe does not describe
])
def test_native_bf16_reads_torchs_probe_once(caps, native, monkeypatch):
    calls = []

    def probe():
        calls.append(1)
        return caps

    monkeypatch.setattr(torch.cpu, "get_capabilities", probe)
    qlinear.native_bf16.cache_clear()
    try:
        assert qlinear.native_bf16() is native and qlinear.native_bf16() is native
        assert len(calls) == 1                                    # cached: probed once
        monkeypatch.delattr(torch.cpu, "get_capabilities")
        qlinear.native_bf16.cache_clear()
        assert qlinear.native_bf16() is False                     # a torch without the probe
    finally:
        qlinear.native_bf16.cache_clear()


def _spy_paths(monkeypatch):
    seen = []

    def spy(mode, rows, bf16_instructions):
        seen.append((mode, rows, bf16_instructions, product_path(mode, rows, bf16_instructions)))
        return seen[-1][-1]

    monkeypatch.setattr(qlinear, "product_path", spy)
    return seen


@pytest.mark.parametrize("bf16_instructions", [True, False])
def test_the_layer_runs_the_chosen_path_and_nothing_else_decides(bf16_instructions, monkeypatch):
    """The layer asks `product_path` with the mode, the row count (every row of a [B, T, K] input) and the probe
    only, and runs what it answers: the fp32 path when it says fp32 (and only then)."""
    _capability(monkeypatch, bf16_instructions, K=64)
    seen = _spy_paths(monkeypatch)
    ran = []
    prefill = QuantizedLinear._prefill_fp32
    monkeypatch.setattr(QuantizedLinear, "_prefill_fp32", lambda self, xb, exact=False: ran.append(1)
                        or prefill(self, xb, exact))
    w = _weights(48, 64)
    for mode, group in FORMATS:
        for activations in ("float", "int8"):
            layer = QuantizedLinear.from_weight(w, None, mode, group, activations=activations)
            for shape in ((1, 64), (7, 64), (2, 20, 64), (3, 50, 64), (130, 64)):
                for dtype in (torch.float32, torch.bfloat16, torch.float64):
                    del seen[:], ran[:]
                    layer(torch.randn(*shape, dtype=dtype))
                    rows = torch.Size(shape[:-1]).numel()
                    assert [s[:3] for s in seen] == [(mode, rows, bf16_instructions)]
                    assert len(ran) == (seen[0][3] == "fp32")
    del seen[:]
    QuantizedLinear.from_weight(w, None, "int8", compute="fp32")(torch.randn(200, 64))
    assert seen == []                                             # compute="fp32" has one path


@pytest.mark.parametrize("mode, group", FORMATS)
def test_the_fp32_path_multiplies_the_bf16_paths_operands(mode, group, monkeypatch):
    """The weight blocks the fp32 path multiplies are `dequantize(torch.bfloat16)`'s bits (each the exact q * s
    rounded once to bf16), whatever the block; exact=True gives q * s unrounded; the product is that of the
    bf16-rounded operands up to fp32 accumulation, the output then rounded to bf16 like the bf16 path's."""
    N, K = 80, 128
    layer = QuantizedLinear.from_weight(_weights(N, K, seed=4), None, mode, group, activations="float")
    q, s = layer.int_weight().float(), layer.expanded_scales().float()
    want_b = (q * s).to(torch.bfloat16)                           # exact in fp32 (8 x 8 bits), one rounding
    assert torch.equal(layer.dequantize(torch.bfloat16), want_b)
    assert torch.equal(layer.dequantize(torch.float32), q * s)
    assert torch.equal(layer.dequantize(torch.float64), q.double() * s.double())
    for lo, hi in ((0, N), (0, 16), (16, 48), (48, 80), (79, 80), (5, 5)):
        for dt in (torch.bfloat16, torch.float32):
            assert torch.equal(layer._dequantize_rows(lo, hi, dt), layer.dequantize(dt)[lo:hi])
    xb = (torch.randn(37, K, generator=torch.Generator().manual_seed(5)) * 2).to(torch.bfloat16)
    xd, wd = xb.double(), want_b.double()
    S = xd.abs() @ wd.abs().T
    for block_rows in (16, 48, 1000):
        monkeypatch.setattr(qlinear, "PREFILL_BLOCK_WEIGHTS", block_rows * K)
        for exact, w in ((False, wd), (True, (q * s).double())):
            y = layer._prefill_fp32(xb, exact=exact)
            assert y.dtype == torch.float32 and y.shape == (37, N)
            assert torch.all((y.double() - xd @ w.T).abs() <= (K + 2) * U32 * S)
    _capability(monkeypatch, False, K=K)
    xb = torch.cat([xb] * 4)                                      # (more rows than either mode packs)
    out = layer(xb.float())
    y = layer._prefill_fp32(xb)
    assert torch.equal(out, y.to(torch.bfloat16).float())         # rounded to bf16, as the other paths' outputs


def test_from_linear_reads_and_keeps_the_float_layer():
    lin = nn.Linear(64, 32)
    before = lin.weight.detach().clone()
    layer = QuantizedLinear.from_linear(lin, "int8")
    assert torch.equal(lin.weight, before) and not isinstance(layer, nn.Linear)
    assert not isinstance(layer.weight, torch.Tensor)   # (dtype / device / shape only: `WeightInfo`)
    assert (layer.weight.dtype, layer.weight.shape) == (torch.float32, (32, 64))
    assert torch.equal(layer.bias, lin.bias.detach())
    for value in (nn.Parameter(torch.zeros(32, 64)), torch.zeros(32, 64)):   # (as transformers' tie_weights does)
        with pytest.raises(LinattnError, match="weight cannot be assigned"):
            layer.weight = value
    assert not isinstance(layer.weight, torch.Tensor) and "weight" not in dict(layer.named_parameters())


def test_state_dict_round_trip_rederives_the_int4_layout():
    a = QuantizedLinear.from_weight(_weights(32, 64, seed=1), None, "int4", 32)
    b = QuantizedLinear.from_weight(_weights(32, 64, seed=2), None, "int4", 32)
    assert set(a.state_dict()) == {"qweight", "scales"}       # torch's packed layout is derived, not saved
    b.load_state_dict(a.state_dict())
    x = torch.randn(1, 64)
    assert torch.equal(a(x), b(x))
    buf = io.BytesIO()
    torch.save(a, buf)                                         # the whole module pickles
    buf.seek(0)
    assert torch.equal(torch.load(buf, weights_only=False)(x), a(x))


@pytest.mark.parametrize("kw, match", [
    (dict(mode="int3"), "mode must be one of"),
    (dict(mode="INT8"), "mode must be one of"),
    (dict(mode="int4", group_size=16), "group_size must be one of"),
    (dict(mode="int4", group_size=128), "group_size must be one of"),
    (dict(mode="int4", group_size=True), "group_size must be one of"),
    (dict(mode="int4", group_size="32"), "group_size must be one of"),
    (dict(mode="int8", group_size=32), "group_size applies to int4 only"),
    (dict(mode="int8", compute="fp16"), "compute must be one of"),
])
def test_bad_arguments_are_refused(kw, match):
    kw = dict(dict(group_size=None, compute="bf16"), **kw)
    with pytest.raises(LinattnError, match=match):
        QuantizedLinear.from_weight(torch.randn(32, 64), None, kw["mode"], kw["group_size"], kw["compute"])


@pytest.mark.parametrize("shape, mode, match", [
    ((32, 48), "int4", "not a multiple of group_size"),
    ((24, 64), "int4", "not a multiple of 16"),
    ((32,), "int8", "float .out_features, in_features. matrix"),
])
def test_shapes_the_format_cannot_take(shape, mode, match):
    with pytest.raises(LinattnError, match=match):
        QuantizedLinear.from_weight(torch.randn(*shape), None, mode, 32 if mode == "int4" else None)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_weights_are_refused(bad):
    w = torch.randn(16, 32)
    w[3, 3] = bad
    with pytest.raises(LinattnError, match="NaN or inf"):
        QuantizedLinear.from_weight(w, None, "int8")


def test_bad_inputs_are_refused():
    layer = QuantizedLinear.from_weight(torch.randn(16, 32), None, "int8")
    with pytest.raises(LinattnError, match=r"x must be a float \[\.\.\., 32\]"):
        layer(torch.randn(2, 31))
    with pytest.raises(LinattnError, match="x must be a float"):
        layer(torch.ones(2, 32, dtype=torch.int64))
    with pytest.raises(LinattnError, match="CPU"):
        layer(torch.randn(2, 32, device="meta"))


def test_backward_is_refused_forward_with_grad_is_not():
    layer = QuantizedLinear.from_weight(torch.randn(16, 32), None, "int4", 32)
    x = torch.randn(2, 32, requires_grad=True)
    y = layer(x)                                   # a forward with grad mode on works (an LM's embedding needs it)
    with pytest.raises(LinattnError, match="backward through quantized weights"):
        y.sum().backward()
    assert list(layer.parameters()) == []


def test_weights_off_the_cpu_are_refused():
    with pytest.raises(LinattnError, match="CPU only"):
        QuantizedLinear.from_weight(torch.randn(16, 32, device="meta"), None, "int8")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_inputs_are_refused():
    layer = QuantizedLinear.from_weight(torch.randn(16, 32), None, "int8")
    with pytest.raises(LinattnError, match="CPU"):
        layer(torch.randn(2, 32, device="cuda"))
    with pytest.raises(LinattnError, match="CPU only"):
        QuantizedLinear.from_weight(torch.randn(16, 32, device="cuda"), None, "int8")


def test_the_fp32_path_ignores_the_default_dtype(monkeypatch):
    _capability(monkeypatch, False, K=64)
    layer = QuantizedLinear.from_weight(_weights(48, 64), None, "int8")
    x = torch.randn(100, 64)
    want = layer(x)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert torch.equal(layer(x), want)
    finally:
        torch.set_default_dtype(default)
