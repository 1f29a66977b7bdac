"""bf16 weights in the compiled whole-model decoding step (models/decode_plan.py, csrc/decode.c matvec_bf16): the
matrices read as stored (bf16) with fp32 accumulation, fp32 activations and states, bf16 logits. Checked against
the fp32 compiled step on the bf16-rounded weights (the same products: to the last bits), against the PyTorch
bf16 model (no further from an fp64 reference than it), and on the inputs the fp32 step is tested on."""
import copy

import pytest
import torch

from linattn.cpu import decode as cpu_decode
from linattn.models import LanguageModel, LMConfig
from tests.helpers import CompiledDecodeCalls, decode_tokens, torch_decode_twin

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler: the compiled kernels are off")

VOCAB = 50
MIXERS = ["gated-deltanet", "deltanet", "efla", "linear-elu+1", "retnet", "mamba2-gla"]


def _bf16_model(mixer, d=32, **kw):
    """A small LM in bf16 whose biases, norm weights and decays are moved off their initial values (seeded)."""
    torch.manual_seed(0)
    model = LanguageModel(LMConfig(vocab_size=VOCAB, d_model=d, n_layers=2, n_heads=2, mixer=mixer, **kw))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n or "A_log" in n:
                p.add_(0.1 * torch.randn_like(p))
    return model.to(torch.bfloat16).eval()


def _states(cache):
    out = []
    for d in cache.layers:
        st = d["mixer"].get("state")
        if st is None:   # a softmax layer's KV cache
            continue
        out += [st] if isinstance(st, torch.Tensor) else [st.kv, st.z]
    return out


def _ids(B, T, seed=1):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("mixer", MIXERS)
@pytest.mark.parametrize("B", [1, 3])
def test_bf16_step_equals_the_fp32_step_on_rounded_weights(mixer, B, monkeypatch):
    """The bf16 plan against the fp32 plan of the same model converted to fp32 (the bf16-rounded weights): the
    states to the fp32 step's last bits (1e-6: only the scalar tails of the products may sum in another order),
    the logits the fp32 logits rounded to bf16."""
    model = _bf16_model(mixer)
    ref_model = copy.deepcopy(model).float()
    calls = CompiledDecodeCalls(monkeypatch)
    ids = _ids(B, 8)
    got, cache = decode_tokens(model, ids, prefill=0)
    ref, ref_cache = decode_tokens(ref_model, ids, prefill=0)
    assert calls.model == 2 * 8 and got.dtype == torch.bfloat16 and got.shape == ref.shape
    torch.testing.assert_close(got.float(), ref, rtol=2 ** -8, atol=1e-6)
    for s, r in zip(_states(cache), _states(ref_cache)):
        assert s.dtype == torch.float32
        torch.testing.assert_close(s, r, rtol=1e-6, atol=1e-7)


def test_bf16_widths_off_the_vector_path_and_untied_head(monkeypatch):
    """d = 40 (rows not a multiple of a 64-byte line of bf16: the scalar loops), an untied head, no final norm."""
    model = _bf16_model("gated-deltanet", d=40, tie_embeddings=False, final_norm=False)
    calls = CompiledDecodeCalls(monkeypatch)
    ids = _ids(2, 6)
    got, cache = decode_tokens(model, ids, prefill=0)
    ref, ref_cache = decode_tokens(copy.deepcopy(model).float(), ids, prefill=0)
    assert calls.model == 2 * 6
    torch.testing.assert_close(got.float(), ref, rtol=2 ** -8, atol=1e-6)
    for s, r in zip(_states(cache), _states(ref_cache)):
        torch.testing.assert_close(s, r, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mixer", ["gated-deltanet", "linear-elu+1", "efla"])
def test_bf16_step_against_the_pytorch_bf16_model(mixer, monkeypatch):
    """After a bf16 prefill (the general path), the compiled bf16 step and the PyTorch bf16 model (bf16 activations
    and states) decode the same tokens; against an fp64 copy of the same weights the compiled step is no further
    off than PyTorch's (it keeps fp32 activations and states), and both are close."""
    model = _bf16_model(mixer)
    twin = torch_decode_twin(model)
    exact = torch_decode_twin(model, torch.float64)
    calls = CompiledDecodeCalls(monkeypatch)
    ids = _ids(2, 12, seed=4)
    got, cache = decode_tokens(model, ids, prefill=4)
    ref, _ = decode_tokens(twin, ids, prefill=4)
    assert calls.model == 8   # the model's 8 decoded tokens (the twin's are PyTorch's)
    truth, _ = decode_tokens(exact, ids, prefill=4)
    scale = truth.abs().max()
    err_got = (got.double() - truth).abs().max() / scale
    err_ref = (ref.double() - truth).abs().max() / scale
    assert err_got <= err_ref * 1.05 + 1e-3
    assert err_ref < 0.05 and err_got < 0.05
    assert cache.seen_tokens == 12


def test_bf16_nan_stays_in_its_row():
    """A NaN embedding row poisons only its own batch row (bf16 logits keep NaN)."""
    model = _bf16_model("gated-deltanet", tie_embeddings=False)
    with torch.no_grad():
        model.embed.weight[7] = float("nan")
    ids = torch.tensor([[7, 1, 2], [3, 4, 5]])
    got, _ = decode_tokens(model, ids, prefill=0)
    assert torch.isnan(got[0]).all() and torch.isfinite(got[1]).all()


@pytest.mark.parametrize("linear", ["gated-deltanet", "linear-elu+1"])
def test_bf16_softmax_hybrid_decodes_its_linear_blocks_compiled(linear, monkeypatch):
    """A bf16 hybrid with a softmax layer decoded block by block (`compiled_decode = False`; the whole-model step:
    tests/models/test_decode_plan_softmax.py): its linear blocks take the per-block compiled step (bf16 weights,
    fp32 inside, the block's output rounded to bf16), the softmax block PyTorch's bf16 path; the logits as close
    to an fp64 copy as the PyTorch bf16 model's (both at bf16's rounding), and the first block's state after one
    token the fp32 PyTorch step's on the rounded weights (to 1e-6: only the sums' order differs)."""
    hybrid = _bf16_model([linear, "softmax"])
    hybrid.compiled_decode = False
    calls = CompiledDecodeCalls(monkeypatch)
    ids = _ids(2, 10, seed=5)
    got, cache = decode_tokens(hybrid, ids, prefill=3)
    assert calls.model == 0 and calls.block == 7
    ref, _ = decode_tokens(torch_decode_twin(hybrid), ids, prefill=3)
    truth, _ = decode_tokens(torch_decode_twin(hybrid, torch.float64), ids, prefill=3)
    scale = truth.abs().max()
    err_got, err_ref = ((t.double() - truth).abs().max() / scale for t in (got, ref))
    assert err_got <= 2 * err_ref + 2 ** -8 and err_got < 0.02
    assert _states(cache)[0].dtype == torch.float32
    _, cache32 = decode_tokens(torch_decode_twin(hybrid).float(), ids[:, :1], prefill=0)
    _, cache1 = decode_tokens(hybrid, ids[:, :1], prefill=0)
    torch.testing.assert_close(_states(cache1)[0], _states(cache32)[0].float(), rtol=1e-6, atol=1e-7)
