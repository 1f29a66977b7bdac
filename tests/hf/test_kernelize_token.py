"""The kernelized token's checks outside the compiled call (hf/kernelize_plan.model_token): the softmax plans'
buffer pointers set again only when another cache's or a grown buffer is theirs, the recurrent layers' tensors
checked as a few `map`s; each case against the unpatched model's logits, with the compiled calls counted."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from linattn.cpu import decode as cpu_decode  # noqa: E402
from linattn.hf import kernelize_plan as kp  # noqa: E402
from tests.helpers import CompiledDecodeCalls  # noqa: E402
from tests.hf import plan_decode as pd  # noqa: E402
from tests.hf.kernelize_models import (  # noqa: E402
    ATTN,
    GDN,
    transformers_torch_code,  # noqa: F401  (autouse)
)

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler: the compiled kernels are off")


def _models():
    """(kernelized, unpatched) Qwen3.5 of 4 layers, 2 of them softmax attention."""
    layers = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
    cfg = transformers.Qwen3_5TextConfig(**ATTN, **GDN, num_hidden_layers=4, layer_types=layers)
    ref, fast = pd.perturbed_pair(transformers.Qwen3_5ForCausalLM, cfg, moved=("norm", "A_log", "dt_bias"),
                                  scaled=("q_proj", "k_proj"))
    return fast, ref


def _prefilled(models, ids):
    return [m(ids, use_cache=True).cache for m in models]


def _token(models, tok, caches):
    return [m(tok, cache=c, use_cache=True).logits for m, c in zip(models, caches)]


def test_two_caches_in_turn_repoint_the_softmax_plans(monkeypatch):
    """Two caches decoded token by token in turn: each token's softmax plans point at its own cache's buffers (the
    pointers were last set for the other's), so both follow the unpatched model."""
    models = _models()
    calls = CompiledDecodeCalls(monkeypatch)
    with torch.no_grad():
        a, b = _prefilled(models, pd.prompt(2, 5, seed=1)), _prefilled(models, pd.prompt(2, 7, seed=2))
        tok = pd.prompt(2, 1, seed=3)
        for _ in range(3):
            for caches in (a, b):
                got, want = _token(models, tok, caches)
                assert pd.close(got, want)
    assert calls.model == 6


def test_softmax_pointers_follow_the_buffers_as_they_grow(monkeypatch):
    """Decoding past the KV buffers' capacity (a chunk of 64 rows): after every token each softmax plan's buffers,
    capacity and length are its mirror's, and the logits the unpatched model's."""
    models = _models()
    calls = CompiledDecodeCalls(monkeypatch)
    ids = pd.prompt(1, 70, seed=4)
    with torch.no_grad():
        caches = _prefilled(models, ids[:, :60])
        caps = set()
        for t in range(60, 70):
            got, want = _token(models, ids[:, t:t + 1], caches)
            assert pd.close(got, want), t
            slot, store = models[0]._linattn_model_plan, caches[0].__dict__["_linattn_kv"]
            for i, p in slot.att:
                kv = store[i].kv
                assert (p.kc, p.vc, p.kv_cap, p.kv_len) == (kv.k.data_ptr(), kv.v.data_ptr(), kv.k.shape[1],
                                                            kv.length - 1)
                caps.add(p.kv_cap)
    assert calls.model == 10 and len(caps) == 2   # (the buffers grew once)


@pytest.mark.parametrize("replaced", ["keys", "recurrent state", "conv state"])
def test_a_tensor_the_caller_replaced_between_tokens(replaced, monkeypatch):
    """A layer's keys and values, recurrent state or conv state replaced between tokens by other tensors of the
    same shape (other values): the next compiled token reads the new ones."""
    models = _models()
    calls = CompiledDecodeCalls(monkeypatch)
    tok, caches = pd.one_token_each(*models[::-1])
    for c in caches:
        if replaced == "keys":
            c.layers[1].keys, c.layers[1].values = c.layers[1].keys * 0.5, c.layers[1].values + 0.25
        elif replaced == "recurrent state":
            c.layers[0].recurrent_states[0] = c.layers[0].recurrent_states[0] * 0.5
        else:
            c.layers[2].conv_states[0] = c.layers[2].conv_states[0] + 0.5
    got, want = pd.next_logits(*models[::-1], tok, caches)
    assert calls.model == 2 and pd.close(got, want)


@pytest.mark.parametrize("broken", ["a state of another shape", "a conv state of another shape",
                                    "a state of another type", "a state on the meta device"])
def test_a_layer_the_plan_cannot_read_steps_aside(broken, monkeypatch):
    """A recurrent layer holding what the plan cannot read (another shape, not a tensor, not on the CPU): the token
    is not the plan's (`model_token` gives None and leaves the cache as it was)."""
    models = _models()
    tok, caches = pd.one_token_each(*models[::-1])
    c = caches[0].layers[2]
    rs, cs = c.recurrent_states[0], c.conv_states[0]
    if broken == "a state of another shape":
        c.recurrent_states[0] = rs[:, :, :-1]
    elif broken == "a conv state of another shape":
        c.conv_states[0] = cs[..., 1:]
    elif broken == "a state of another type":
        c.recurrent_states[0] = rs.numpy()
    else:
        c.recurrent_states[0] = torch.empty_like(rs, device="meta")
    before = (c.recurrent_states[0], c.conv_states[0])
    calls = CompiledDecodeCalls(monkeypatch)
    with torch.no_grad():
        assert kp.model_token(models[0], tok, caches[0], None) is None
    assert calls.model == 0 and (c.recurrent_states[0], c.conv_states[0]) == before


def test_a_cache_reset_steps_aside(monkeypatch):
    """`cache.reset()` between tokens (the states zeroed in place, no previous state): transformers' forward takes
    the next token, the plan the ones after, the unpatched model's logits throughout."""
    models = _models()
    calls = CompiledDecodeCalls(monkeypatch)
    tok, caches = pd.one_token_each(*models[::-1])
    for c in caches:
        c.reset()
    with torch.no_grad():
        for _ in range(3):
            got, want = _token(models, tok, caches)
            assert pd.close(got, want)
            tok = want.argmax(-1)
    assert calls.model == 1 + 2


def test_batch_size_changes_between_caches(monkeypatch):
    """Caches of batch 2, 1 and 2 again decoded in turn by one model: every token compiled (the recurrent layers'
    shapes checked at each batch size), the unpatched model's logits."""
    models = _models()
    calls = CompiledDecodeCalls(monkeypatch)
    with torch.no_grad():
        two, one = _prefilled(models, pd.prompt(2, 5, seed=5)), _prefilled(models, pd.prompt(1, 6, seed=6))
        for caches, B in ((two, 2), (one, 1), (two, 2), (one, 1)):
            got, want = _token(models, pd.prompt(B, 1, seed=7), caches)
            assert pd.close(got, want), B
    assert calls.model == 4


def test_a_state_kept_in_another_dtype_is_written_in_place(monkeypatch):
    """A recurrent state the caller converted to fp64 between tokens: the next compiled token writes its new state
    into that tensor (the other layers take views of the step's buffer), with the bits of the same token decoded on
    a copy of the cache that kept fp32."""
    fast, ref = _models()
    calls = CompiledDecodeCalls(monkeypatch)
    tok, caches = pd.one_token_each(ref, fast)
    cache = caches[0]
    other = copy.deepcopy(cache)
    kept = cache.layers[2].recurrent_states[0] = cache.layers[2].recurrent_states[0].double()
    with torch.no_grad():
        got, want = (fast(tok, cache=c, use_cache=True).logits for c in (cache, other))
    assert calls.model == 3 and torch.equal(got, want)
    assert cache.layers[2].recurrent_states[0] is kept and kept.dtype == torch.float64
    assert torch.equal(kept, other.layers[2].recurrent_states[0].double())
    assert torch.equal(cache.layers[0].recurrent_states[0], other.layers[0].recurrent_states[0])
