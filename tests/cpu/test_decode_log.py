"""Log-space linear attention (ELA's Hadamard Exp) as a block kind of the compiled decode (csrc/decode_log.h, block
kind 3; models/decode_plan.py): the whole-model step and the per-block step against the per-block PyTorch step
(layers/fast_decode_log.py's arithmetic) run in fp64, within a bound taken from that PyTorch step's own fp32 error;
the two compiled steps bit for bit; the cache handed from the PyTorch step to the compiled one and back; batch
rows; bf16 weights; greedy generation identical; gates none / RetNet / scalar, output gate, short convolution,
grouped value heads, unnormalised; the step's whole-model call counted, so a comparison cannot pass by taking the
same path twice."""
import copy

import pytest
import torch

from linattn.cpu import decode as cpu_decode
from linattn.models import LanguageModel, LMConfig
from tests.helpers import CompiledDecodeCalls, block_decode_twin, decode_tokens, torch_decode_twin

pytestmark = [pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler: the compiled kernels are off"),
              pytest.mark.usefixtures("one_thread_module")]

VOCAB = 50
CASES = [dict(), dict(gate="retnet"), dict(gate="scalar", output_gate=True),
         dict(short_conv=True, n_value_heads=4), dict(normalize=False, output_norm=False)]
IDS = ["plain", "retnet", "scalar-gated", "conv-grouped", "unnormalised"]


def _model(dtype=torch.float32, layers=2, d=32, heads=2, mixer="linear-hadamard_exp", **mixer_kw):
    """A small LM of `mixer` blocks, biases and norm weights moved off their initial values (seeded)."""
    torch.manual_seed(0)
    model = LanguageModel(LMConfig(vocab_size=VOCAB, d_model=d, n_layers=layers, n_heads=heads, mixer=mixer,
                                   mixer_kwargs={mixer: mixer_kw}))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n or "A_log" in n:
                p.add_(0.1 * torch.randn_like(p))
    return model.to(dtype).eval()


def _states(cache):
    """(kv, z, log_scale) of every layer (kv, z for the linear-space maps)."""
    out = []
    for d in cache.layers:
        st = d["mixer"].state
        out += [st.kv, st.z] + ([st.log_scale] if st.log_scale is not None else [])
    return out


def _ids(B, T, seed):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def _err(a, b):
    return float((a.double() - b.double()).abs().max())


@pytest.mark.parametrize("kw", CASES, ids=IDS)
@pytest.mark.parametrize("batch", [1, 3])
def test_model_and_block_steps_against_the_fp64_pytorch_step(kw, batch, monkeypatch):
    """Prefill 4, decode 10: the whole-model step's states bit for bit as the per-block compiled step's (logits to
    rounding); fp32 against the fp64 PyTorch step within 4x the fp32 PyTorch step's own error (+ a few ulps); fp64
    against it to 1e-12."""
    model = _model(**kw)
    ids = _ids(batch, 14, 1)
    calls = CompiledDecodeCalls(monkeypatch)
    got, cache = decode_tokens(model, ids)
    assert (calls.model, calls.block) == (10, 0)
    blk, blk_cache = decode_tokens(block_decode_twin(model), ids)
    assert (calls.model, calls.block) == (10, 2 * 10)
    torch.testing.assert_close(got, blk, rtol=1e-5, atol=1e-5)
    for a, b in zip(_states(cache), _states(blk_cache)):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    ref, ref_cache = decode_tokens(torch_decode_twin(model, torch.float64), ids)
    t32, t32_cache = decode_tokens(torch_decode_twin(model), ids)
    assert calls.model == 10
    bound = 4 * _err(t32, ref) + 1e-6
    assert _err(got, ref) <= bound, (_err(got, ref), bound)
    for a, b, t in zip(_states(cache), _states(ref_cache), _states(t32_cache)):
        assert _err(a, b) <= 4 * _err(t, b) + 1e-6 * max(1.0, float(b.abs().max()))
    got64, cache64 = decode_tokens(_model(torch.float64, **kw), ids)
    assert calls.model == 20
    torch.testing.assert_close(got64, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(_states(cache64), _states(ref_cache)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


ELA_CASES = [("linear-sum_sq_euclid", {}), ("linear-sub_sq_euclid", dict(gate="retnet")),
             ("linear-magnitude_direction", dict(gate="scalar", output_gate=True)),
             ("linear-sub_sq_euclid", dict(short_conv=True, n_value_heads=4, normalize=False))]


@pytest.mark.parametrize("mixer, kw", ELA_CASES, ids=["sum", "sub-retnet", "magdir-scalar-gated", "sub-conv-plain"])
def test_ela_linear_space_maps_in_the_model_step(mixer, kw, monkeypatch):
    """ELA's linear-space maps (block kind 6, K_phi = K + 2 / K + 1): the whole-model step's states bit for bit as
    the per-block compiled step's; fp32 against the fp64 PyTorch step within 4x the fp32 PyTorch step's own error;
    fp64 to 1e-12 (relative to the logits' scale)."""
    model = _model(mixer=mixer, **kw)
    ids = _ids(2, 12, 6)
    calls = CompiledDecodeCalls(monkeypatch)
    got, cache = decode_tokens(model, ids)
    assert (calls.model, calls.block) == (8, 0)
    blk, blk_cache = decode_tokens(block_decode_twin(model), ids)
    assert calls.block == 2 * 8
    torch.testing.assert_close(got, blk, rtol=1e-5, atol=1e-5)
    for a, b in zip(_states(cache), _states(blk_cache)):
        assert a.shape == b.shape and torch.equal(a, b)
    ref, ref_cache = decode_tokens(torch_decode_twin(model, torch.float64), ids)
    t32, _ = decode_tokens(torch_decode_twin(model), ids)
    assert _err(got, ref) <= 4 * _err(t32, ref) + 1e-6 * float(ref.abs().max())
    got64, _ = decode_tokens(_model(torch.float64, mixer=mixer, **kw), ids)
    assert calls.model == 16
    torch.testing.assert_close(got64, ref, rtol=1e-12, atol=1e-12 * float(ref.abs().max()))


def test_cache_handoff_both_ways(monkeypatch):
    """Prefill (chunk form), 3 tokens by the PyTorch step, 3 by the whole-model step, 3 by the PyTorch step again,
    3 by the per-block compiled step, 3 by the whole-model step: the logits and states of an all-PyTorch run."""
    model = _model(gate="retnet", short_conv=True)
    ids = _ids(2, 20, 2)
    calls = CompiledDecodeCalls(monkeypatch)
    ref, ref_cache = decode_tokens(torch_decode_twin(model), ids)
    assert calls.model == 0
    layers = [m for m in model.modules() if hasattr(m, "compiled_decode") and m is not model]
    with torch.no_grad():
        out = model(ids[:, :5], use_cache=True)
        cache, logits = out.cache, [out.logits]
        for t in range(5, 20):
            phase = (t - 5) // 3
            model.compiled_decode = phase in (1, 4)
            for m in layers:
                m.compiled_decode = phase not in (0, 2)
            logits.append(model(ids[:, t:t + 1], cache=cache).logits)
    model.compiled_decode = True
    assert calls.model == 6 and calls.block == 2 * 3
    torch.testing.assert_close(torch.cat(logits, 1), ref, rtol=2e-5, atol=2e-5)
    for a, b in zip(_states(cache), _states(ref_cache)):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)


def test_batch_rows_are_independent(monkeypatch):
    """Each row of a batch of 3 decodes as it does alone, a row with inputs 100 nats apart included (the log-space
    state keeps it finite), and a NaN in one row stays in that row."""
    model = _model()
    ids = _ids(3, 10, 3)
    got, _ = decode_tokens(model, ids)
    for b in range(3):
        alone, _ = decode_tokens(model, ids[b:b + 1])
        torch.testing.assert_close(got[b:b + 1], alone, rtol=1e-6, atol=1e-6)
    big = _model()
    with torch.no_grad():
        big.embed.weight[ids[1, 6]] *= 100.0
    g, _ = decode_tokens(big, ids)
    assert torch.isfinite(g).all()
    nan_id = next(i for i in range(VOCAB) if not (ids[:2] == i).any() and not (ids[2, :6] == i).any())
    ids[2, 6] = nan_id
    g, _ = decode_tokens(big, ids)
    with torch.no_grad():
        big.embed.weight[nan_id] = float("nan")
    g2, _ = decode_tokens(big, ids)
    cols = torch.arange(VOCAB) != nan_id   # (the tied head's row of that id is NaN for every row)
    g, g2 = g[..., cols], g2[..., cols]
    assert torch.isnan(g2[2, 6:]).all() and torch.equal(g2[2, :6], g[2, :6]) and torch.equal(g2[:2], g[:2])


def test_bf16_weights(monkeypatch):
    """A bf16 model decodes in the whole-model step (bf16 matrices, fp32 states): its logits are the fp32 step's
    on the bf16-rounded weights, rounded to bf16."""
    model = _model().to(torch.bfloat16)
    calls = CompiledDecodeCalls(monkeypatch)
    ids = _ids(2, 8, 4)
    got, cache = decode_tokens(model, ids, prefill=0)
    ref, ref_cache = decode_tokens(copy.deepcopy(model).float(), ids, prefill=0)
    assert calls.model == 2 * 8 and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref, rtol=2 ** -8, atol=1e-6)
    for s, r in zip(_states(cache), _states(ref_cache)):
        assert s.dtype == torch.float32
        torch.testing.assert_close(s, r, rtol=1e-6, atol=1e-7)


def test_generate_greedy_identical(monkeypatch):
    """generate(temperature=0) takes the whole-model step and picks the PyTorch step's tokens."""
    model = _model(layers=3)
    calls = CompiledDecodeCalls(monkeypatch)
    prompt = _ids(1, 5, 5)[0]
    got = model.generate(prompt, 12, temperature=0)
    assert calls.model >= 11
    ref = torch_decode_twin(model).generate(prompt, 12, temperature=0)
    assert torch.equal(got, ref)
