"""The compiled dequantizer (cpu/dequant.py, csrc/dequant.c) against torch's formula (`_dequantize_rows_torch`,
the reference and the fallback) and against q * s computed in fp64: the same bits on awkward shapes (one row, an
odd number of groups, every code and int8 value), extreme and hostile scales (bf16's largest, subnormals, zero, -0,
negative, inf, NaN), any thread count; the layer's fallback when the library is missing; refusals."""
import pytest
import torch

from linattn.cpu import bindings, dequant as cpu_dequant
from linattn.errors import LinattnError
from linattn.quant import QuantizedLinear, linear as qlinear
from tests.helpers import build_variant

pytestmark = pytest.mark.skipif(not cpu_dequant.available(), reason="no C compiler: the compiled kernels are off")


@pytest.fixture(scope="module", autouse=True, params=["native", "plain C"])
def dequant_lib(request, tmp_path_factory):
    """Every test twice: on the library as built (-march=native: AVX2's lookup path for int4 where the CPU has it)
    and on dequant.c built with -DLINATTN_PLAIN_C (the loops the compiler vectorises, what other CPUs get)."""
    if request.param == "native":
        yield request.param
        return
    lib = build_variant(tmp_path_factory.mktemp("plain"), "dequant", "#define LINATTN_PLAIN_C\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bindings, "load_library", lambda name: lib if name == "dequant" else None)
        yield request.param

BF16 = torch.finfo(torch.bfloat16)
#: scales to plant: bf16's largest (products overflow to inf), its smallest normal and subnormal, a value whose
#: products need rounding (8 significant bits), zero, -0, negative, inf, -inf, NaN
HOSTILE = [BF16.max, BF16.tiny, 2.0 ** -133, 1.0 + 2.0 ** -7, 0.0, -0.0, -0.3, float("inf"), float("-inf"),
           float("nan"), 3e38, 1.1e-38]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.float().view(torch.int32)


def _same(got: torch.Tensor, want: torch.Tensor):
    """The same bits, NaN where want is NaN (a NaN's sign and payload are not torch's own contract: its vectorised
    and scalar loops write different ones)."""
    assert got.dtype == torch.float32 and got.shape == want.shape
    nan = torch.isnan(want.float())
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(_bits(got)[~nan], _bits(want)[~nan])


def _layer(mode, group, N, K, seed, hostile=True):
    """A layer with every int8 value / int4 code present (random bytes, -128 and code 0 included, which
    `quantize_weight` never writes) and random bf16 scales of every magnitude, the hostile ones planted."""
    g = torch.Generator().manual_seed(seed)
    if mode == "int8":
        q = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
        shape = (N,)
    else:
        q = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8)
        shape = (N, K // group)
    s = (torch.randn(shape, generator=g, dtype=torch.float64) * 2.0 ** torch.randint(-120, 120, shape, generator=g))
    s = s.to(torch.bfloat16)
    if hostile:
        flat = s.view(-1)
        idx = torch.randperm(flat.numel(), generator=g)[:len(HOSTILE)]
        flat[idx] = torch.tensor(HOSTILE[:len(idx)], dtype=torch.bfloat16)
    return QuantizedLinear(q, s, None, mode, group, activations="float")


def _fp64_reference(layer, bf16_round):
    """q * s in fp64 (exact), then one rounding: to bf16 (bf16_round), else to fp32 (exact there too)."""
    w = layer.int_weight().double() * layer.expanded_scales().double()
    return w.to(torch.bfloat16).float() if bf16_round else w.float()


FORMATS = [("int8", None, 16, 1), ("int8", None, 33, 7), ("int8", None, 5, 1000), ("int4", 32, 16, 96),
           ("int4", 64, 32, 192), ("int4", 32, 48, 32), ("int4", 64, 16, 1088)]


@pytest.mark.parametrize("mode, group, N, K", FORMATS)
@pytest.mark.parametrize("seed", [0, 1])
def test_the_same_bits_as_torchs_formula(mode, group, N, K, seed):
    layer = _layer(mode, group, N, K, seed)
    for bf16_round in (True, False):
        want = (layer._dequantize_rows_torch(0, N, torch.bfloat16).float() if bf16_round
                else layer._dequantize_rows_torch(0, N, torch.float32))
        got = cpu_dequant.dequantize_rows(mode, layer.qweight, layer.scales, group or 0, bf16_round)
        _same(got, want)
        _same(got, _fp64_reference(layer, bf16_round))
        for lo, hi in ((0, 1), (N - 1, N), (1, min(N, 4)), (N // 2, N)):   # single rows and slices
            _same(cpu_dequant.dequantize_rows(mode, layer.qweight[lo:hi], layer.scales[lo:hi], group or 0,
                                              bf16_round), want[lo:hi])
    # written as bf16: torch's bf16 formula's bits (NaN aside, as above)
    want = layer._dequantize_rows_torch(0, N, torch.bfloat16)
    got = cpu_dequant.dequantize_rows(mode, layer.qweight, layer.scales, group or 0, False, dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    _same(got.float(), want.float())
    assert torch.equal(got.view(torch.int16)[~torch.isnan(want)], want.view(torch.int16)[~torch.isnan(want)])


@pytest.mark.parametrize("mode, group", [("int8", None), ("int4", 32), ("int4", 64)])
def test_the_layer_uses_it_for_fp32_and_bf16_the_same_bits(mode, group, monkeypatch):
    layer = _layer(mode, group, 32, 128, seed=3)
    calls = []
    real = cpu_dequant.dequantize_rows
    monkeypatch.setattr(cpu_dequant, "dequantize_rows", lambda *a: calls.append(1) or real(*a))
    for dt in (torch.float32, torch.bfloat16):
        got = layer._dequantize_rows(2, 19, dt)
        assert got.dtype == dt and calls
        want = layer._dequantize_rows_torch(2, 19, dt)
        _same(got.float(), want.float())
        del calls[:]
    _same(layer._dequantize_rows(0, 32, torch.float32, bf16_round=True),
          layer._dequantize_rows_torch(0, 32, torch.bfloat16).float())
    assert calls
    # fp64 stays on torch's ops (exact there, and the kernel writes fp32)
    del calls[:]
    assert layer.dequantize(torch.float64).dtype == torch.float64 and not calls


def test_rounding_ties_go_to_even_and_overflow_to_inf():
    """Products exactly halfway between two bf16 values round to the even one; past bf16's largest, to inf."""
    # s = 1 + 2^-7 (bf16: 8 significant bits); q * s for odd q needs 9-10 bits: ties and non-ties
    s = torch.tensor([1.0 + 2.0 ** -7] * 16, dtype=torch.bfloat16)
    q = torch.arange(-128, 128, dtype=torch.int8).view(16, 16)
    got = cpu_dequant.dequantize_rows("int8", q.contiguous(), s, 0, True)
    exact = q.double() * s.double().unsqueeze(1)
    _same(got, exact.to(torch.bfloat16).float())
    assert not torch.equal(got.double(), exact)                      # (some needed rounding)
    big = torch.tensor([BF16.max] * 16, dtype=torch.bfloat16)
    got = cpu_dequant.dequantize_rows("int8", q.contiguous(), big, 0, True)
    assert torch.equal(torch.isinf(got), q.short().abs() >= 2)             # 2 * max overflows; 1 * max does not
    assert torch.equal(got[q == 1], torch.full_like(got[q == 1], BF16.max))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_every_thread_count_gives_the_same_bits(threads, monkeypatch):
    layer = _layer("int4", 32, 64, 4096, seed=5, hostile=False)
    want = layer._dequantize_rows_torch(0, 64, torch.bfloat16).float()
    monkeypatch.setattr(cpu_dequant, "GRAIN", 1)                     # (split even small calls)
    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _same(cpu_dequant.dequantize_rows("int4", layer.qweight, layer.scales, 32, True), want)
    finally:
        torch.set_num_threads(n)


def test_it_writes_into_a_given_buffer():
    layer = _layer("int4", 32, 16, 64, seed=6)
    buf = torch.full((16 * 64 + 5,), 7.0)
    got = cpu_dequant.dequantize_rows("int4", layer.qweight[:4], layer.scales[:4], 32, True, buf)
    assert got.data_ptr() == buf.data_ptr() and got.shape == (4, 64)
    _same(got, layer._dequantize_rows_torch(0, 4, torch.bfloat16).float())
    assert torch.all(buf[4 * 64:] == 7.0)                             # nothing past its rows
    buf = torch.full((16 * 64,), 7.0, dtype=torch.bfloat16)
    got = cpu_dequant.dequantize_rows("int4", layer.qweight[:4], layer.scales[:4], 32, False, buf, torch.bfloat16)
    assert got.data_ptr() == buf.data_ptr() and torch.all(buf[4 * 64:] == 7.0)
    _same(got.float(), layer._dequantize_rows_torch(0, 4, torch.bfloat16).float())
    assert cpu_dequant.dequantize_rows("int8", torch.zeros(0, 8, dtype=torch.int8),
                                       torch.zeros(0, dtype=torch.bfloat16), 0, True).shape == (0, 8)


@pytest.mark.parametrize("mode, group", [("int8", None), ("int4", 32)])
@pytest.mark.parametrize("how", ["switched off", "no library"])
def test_without_the_library_the_layer_falls_back_to_torch(mode, group, how, monkeypatch):
    """Kernels switched off (LINATTN_CPU_KERNELS=0) or the library not built (no compiler: `bind` finds none):
    torch's ops run, the same bits, and the fp32 prefill path's output is the same."""
    layer = _layer(mode, group, 48, 128, seed=7, hostile=False)
    x = torch.randn(70, 128).to(torch.bfloat16)
    compiled = (layer._dequantize_rows(0, 48, torch.float32, bf16_round=True), layer.dequantize(torch.float32),
                layer.dequantize(torch.bfloat16), layer._prefill_fp32(x))
    if how == "switched off":
        monkeypatch.setenv("LINATTN_CPU_KERNELS", "0")
    else:
        monkeypatch.setattr(bindings, "load_library", lambda name: None)
    assert not cpu_dequant.available()
    monkeypatch.setattr(cpu_dequant, "dequantize_rows", lambda *a: pytest.fail("the compiled kernel ran"))
    fallback = (layer._dequantize_rows(0, 48, torch.float32, bf16_round=True), layer.dequantize(torch.float32),
                layer.dequantize(torch.bfloat16), layer._prefill_fp32(x))
    for a, b in zip(compiled, fallback):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("args, match", [
    (("int2", torch.zeros(2, 4, dtype=torch.int8), torch.zeros(2, dtype=torch.bfloat16), 0), "mode"),
    (("int8", torch.zeros(2, 4, dtype=torch.uint8), torch.zeros(2, dtype=torch.bfloat16), 0), "qweight must be"),
    (("int8", torch.zeros(2, 4, dtype=torch.int8), torch.zeros(2, dtype=torch.float32), 0), "scales bf16"),
    (("int8", torch.zeros(2, 4, dtype=torch.int8), torch.zeros(3, dtype=torch.bfloat16), 0), r"\[R\]"),
    (("int8", torch.zeros(8, dtype=torch.int8), torch.zeros(8, dtype=torch.bfloat16), 0), r"\[R, K\]"),
    (("int4", torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.bfloat16), 32), "K/group"),
    (("int4", torch.zeros(2, 24, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.bfloat16), 32), "K/group"),
    (("int4", torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.bfloat16), 31), "even"),
    (("int4", torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.bfloat16), None), "even"),
    (("int4", torch.zeros(2, 32, dtype=torch.uint8)[:, ::2], torch.zeros(2, 1, dtype=torch.bfloat16), 32),
     "contiguous"),
])
def test_bad_arguments_are_refused(args, match):
    with pytest.raises(LinattnError, match=match):
        cpu_dequant.dequantize_rows(*args, True)


def test_a_bad_buffer_or_dtype_is_refused():
    q, s = torch.zeros(2, 4, dtype=torch.int8), torch.zeros(2, dtype=torch.bfloat16)
    for buf in (torch.zeros(7), torch.zeros(8, dtype=torch.float64), torch.zeros(16)[::2],
                torch.zeros(8, dtype=torch.bfloat16)):
        with pytest.raises(LinattnError, match="out must be"):
            cpu_dequant.dequantize_rows("int8", q, s, 0, True, buf)
    with pytest.raises(LinattnError, match="out must be"):
        cpu_dequant.dequantize_rows("int8", q, s, 0, True, torch.zeros(8), dtype=torch.bfloat16)
    for dt in (torch.float64, torch.float16):
        with pytest.raises(LinattnError, match="dtype must be"):
            cpu_dequant.dequantize_rows("int8", q, s, 0, True, dtype=dt)


def test_the_module_is_the_layers():
    assert qlinear.cpu_dequant is cpu_dequant
