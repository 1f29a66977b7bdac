"""linattn.hf under transformers' past recording (issue 36, states): `activate_past_recording()` then
`crop(-n)` on a `DynamicCache` rolls every linattn layer back (recurrent states, conv windows, per-token
states, keys/values), so assisted (speculative) generation runs and gives exactly the greedy tokens."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import linattn.hf as lh  # noqa: E402
from linattn import LanguageModel, LMConfig  # noqa: E402
from linattn.errors import LinattnError  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_module")
# pad_token_id None: a generated token equal to the pad token would read as padding in assisted decoding's masks
GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=None)


def tiny(mixer, n_layers=2, seed=0, **kw) -> LanguageModel:
    torch.manual_seed(seed)
    # init_std 0.3: varied greedy tokens, so that the draft model is often wrong and drafts get rejected
    return LanguageModel(LMConfig(vocab_size=64, d_model=32, n_layers=n_layers, n_heads=2, mixer=mixer, init_std=0.3,
                                  **kw)).eval()


@pytest.mark.parametrize("mixer", [["gated-deltanet", "softmax"], "fox", "ttt-linear", ["mamba2", "swa"], "path"],
                         ids=str)
def test_assisted_generation_gives_the_greedy_tokens(mixer, monkeypatch):
    hf = lh.LinattnForCausalLM.from_linattn(tiny(mixer, window=4))
    draft = lh.LinattnForCausalLM.from_linattn(tiny("gla", n_layers=1, seed=1))
    ids = torch.randint(1, 64, (1, 7), generator=torch.Generator().manual_seed(2))
    crops = []
    crop = transformers.cache_utils.Cache.crop
    monkeypatch.setattr(transformers.cache_utils.Cache, "crop", lambda self, n: (crops.append(n), crop(self, n))[1])
    ref = hf.generate(ids, max_new_tokens=12, **GREEDY)
    assert not crops
    out = hf.generate(ids, max_new_tokens=12, assistant_model=draft, **GREEDY)
    assert torch.equal(out, ref)
    assert any(n < 0 for n in crops)   # drafts were rejected and rolled back (a crop of -n removes n tokens)


def _run(hf, cache, ids):
    return hf(ids, cache=cache, use_cache=True).logits


@pytest.mark.parametrize("mixer", [["gated-deltanet", "softmax"], ["deltaformer", "swa"], "ttt-mlp", "mamba2"],
                         ids=str)
def test_past_recording_crop_rolls_every_layer_back(mixer):
    hf = lh.LinattnForCausalLM.from_linattn(tiny(mixer, window=3))
    ids = torch.randint(1, 64, (1, 12), generator=torch.Generator().manual_seed(3))
    junk = torch.randint(1, 64, (1, 3), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(ids).logits
        cache = transformers.DynamicCache(config=hf.config)
        cache.activate_past_recording()
        head = _run(hf, cache, ids[:, :6])
        assert cache.is_croppable
        _run(hf, cache, junk)
        cache.crop(-3)                                   # the junk, across three recorded tokens
        mid = _run(hf, cache, ids[:, 6:9])
        _run(hf, cache, junk[:, :1])
        cache.crop(-1)
        tail = _run(hf, cache, ids[:, 9:])
    got = torch.cat([head, mid, tail], 1)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5 * ref.abs().max().item())


def test_recording_call_returns_the_hidden_states_of_an_ordinary_call():
    hf = lh.LinattnForCausalLM.from_linattn(tiny(["gated-deltanet", "softmax"]))
    hf.past_recording_window = 3     # a 5-token call: 2 tokens at once, then 3 one at a time
    ids = torch.randint(1, 64, (1, 5))
    with torch.no_grad():
        want = hf(ids, output_hidden_states=True).hidden_states
        cache = transformers.DynamicCache(config=hf.config)
        cache.activate_past_recording()
        got = hf(ids, cache=cache, use_cache=True, output_hidden_states=True).hidden_states
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5 * w.abs().max().item())


def test_crop_beyond_the_recorded_window_and_without_recording():
    hf = lh.LinattnForCausalLM.from_linattn(tiny("gated-deltanet"))
    hf.past_recording_window = 2
    ids = torch.randint(1, 64, (1, 8))
    with torch.no_grad():
        cache = transformers.DynamicCache(config=hf.config)
        cache.activate_past_recording()
        _run(hf, cache, ids[:, :5])
        _run(hf, cache, ids[:, 5:])
        with pytest.raises(LinattnError, match=r"can go back to 6 at the earliest \(seen_tokens 8\).*"
                                               r"past_recording_window"):
            cache.crop(-3)
        cache.crop(-2)
        plain = transformers.DynamicCache(config=hf.config)
        _run(hf, plain, ids)
    # without recording a recurrent state cannot be rolled back: transformers' own answer and error
    assert not plain.is_croppable
    with pytest.raises(RuntimeError, match="does not track past states"):
        plain.crop(-1)
