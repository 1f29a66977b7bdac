"""The compiled conversion between a kernelized transformers model's conv states (`[..., KC]`, bf16 or float32, the
oldest input first) and the plan's float32 windows (cpu/decode.conv_windows / conv_store), against the torch column
copies they replace (hf/kernelize_plan.py's fallback), bit for bit: bf16 rounding to nearest even (ties both ways,
subnormals, overflow to inf), inf and NaN, KC 2 / 4 / 5, no rows."""
import pytest
import torch

from linattn.cpu import decode as cpu_decode

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler: the compiled kernels are off")


def _windows_ref(conv):
    KC = conv.shape[-1]
    return conv.reshape(-1, KC)[:, 1:].to(torch.float32).reshape(-1)


def _store_ref(win, conv):
    KC = conv.shape[-1]
    rows = conv.view(-1, KC)
    wins = win.view(-1, KC - 1)
    for j in range(KC):
        rows[:, j].copy_(rows[:, 1] if j == 0 else wins[:, j - 1])


def _hostile_floats(n, gen):
    """n float32 values: random ones at every scale, plus the cases bf16 rounding can get wrong."""
    x = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-140, 130, (n,), generator=gen).float())
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F807FFF,   # ties to even (down, up), near ties
                         0x7F7FFFFF, 0x00000001, 0x80400000, 0x007FFFFF, 0x7F800000, 0xFF800000, 0, 0x80000000],
                        dtype=torch.int64).to(torch.int32).view(torch.float32)
    k = min(n, len(bits))
    x[:k] = bits[:k]
    return x


@pytest.mark.parametrize("dtype", cpu_decode.CONV_STATE_DTYPES)
@pytest.mark.parametrize("shape", [(3, 1, 7, 4), (2, 5, 2), (1, 1, 5), (0, 4)])
def test_conv_windows_and_store_match_the_column_copies(dtype, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    conv = _hostile_floats(max(1, torch.Size(shape).numel()), gen)[:torch.Size(shape).numel()].to(dtype)
    conv = conv.reshape(shape)
    got = cpu_decode.conv_windows(conv)
    want = _windows_ref(conv)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))   # (bits, NaN-free input)
    KC = shape[-1]
    win = _hostile_floats(max(1, want.numel()), gen)[:want.numel()]
    a, b = conv.clone(), conv.clone()
    assert cpu_decode.conv_store(win, a)
    _store_ref(win, b)
    view = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(a.view(view), b.view(view))
    if a.numel():   # (the row shifted: its first input is its old second)
        assert torch.equal(a.reshape(-1, KC)[:, 0].float(), conv.reshape(-1, KC)[:, 1].float())


@pytest.mark.parametrize("dtype", cpu_decode.CONV_STATE_DTYPES)
def test_nan_stays_nan(dtype):
    conv = torch.tensor([[1.0, float("nan"), 2.0, -float("nan")]], dtype=dtype)
    assert torch.equal(torch.isnan(cpu_decode.conv_windows(conv)), torch.tensor([True, False, True]))
    win = torch.tensor([float("nan"), 3.0, -float("nan")])
    assert cpu_decode.conv_store(win, conv)
    assert torch.equal(torch.isnan(conv[0].float()), torch.tensor([True, True, False, True]))


def test_refused_where_the_torch_copies_run():
    assert cpu_decode.conv_windows(torch.zeros(2, 4, dtype=torch.float16)) is None
    assert cpu_decode.conv_windows(torch.zeros(4, 2).t()) is None   # (not contiguous)
    conv = torch.zeros(2, 4)
    assert not cpu_decode.conv_store(torch.zeros(5), conv)   # (6 window elements expected)
    assert not cpu_decode.conv_store(torch.zeros(6, dtype=torch.float64), conv)
    assert not cpu_decode.conv_store(torch.zeros(6), torch.zeros(2, 4, dtype=torch.float64))
