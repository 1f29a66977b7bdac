"""Issue 34 (engineer D4): the cheaper finite-output check and the normaliser division inside the compiled
linear-attention kernel (forward without autograd)."""
import pytest
import torch

from linattn.ops._common import _all_finite


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_all_finite_is_exact(dtype):
    big = torch.finfo(dtype).max
    x = torch.full((1000,), big, dtype=dtype)  # every element finite, the sum overflows: the exact test decides
    assert _all_finite(x)
    assert _all_finite(torch.empty(0, dtype=dtype))
    for bad in (float("inf"), float("-inf"), float("nan")):
        y = torch.randn(3, 257, dtype=torch.float64).to(dtype)
        y[2, 200] = bad
        assert not _all_finite(y), bad
        y = x.clone()
        y[-1] = bad  # among values whose sum alone overflows
        assert not _all_finite(y), bad
    z = torch.tensor([float("inf"), float("-inf")], dtype=dtype)  # their sum is NaN, not a finite 0
    assert not _all_finite(z)
    assert _all_finite(torch.arange(5))  # integers are always finite
