"""The whole model's decoding step in one compiled call (layers/fast_decode.model_step, csrc/decode.c
linattn_decode_model): embedding, every block, final norm and head for one token, with the states of all layers in
one buffer. Checked against the per-block compiled step (`model.compiled_decode = False`: the states, conv windows
and offsets bit for bit, the logits to rounding: the final norm and head are C loops), the PyTorch step (every
layer's `compiled_decode = False`) and the full forward; the whole-model call is counted, so a comparison cannot
pass by taking the same path twice."""
import copy

import pytest
import torch

from linattn.cpu import decode as cpu_decode
from linattn.errors import LinattnError
from linattn.models import LanguageModel, LMConfig
from tests.helpers import CompiledDecodeCalls, block_decode_twin, decode_tokens, torch_decode_twin

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler: the compiled kernels are off")

MIXERS = ["linear-elu+1", "deltanet", "gated-deltanet", "efla", "efla-adaptive", "linear-relu", "retnet",
          "mamba2-gla"]
VOCAB = 50


ModelCount = CompiledDecodeCalls   # counts the whole-model compiled calls (.model) and the per-block ones (.block)


def _model(mixer, dtype=torch.float32, layers=2, **kw):
    """A small LM whose biases, norm weights and decays are moved off their initial values (seeded)."""
    torch.manual_seed(0)
    model = LanguageModel(LMConfig(vocab_size=VOCAB, d_model=32, n_layers=layers, n_heads=2, mixer=mixer,
                                   **kw)).to(dtype)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n or "A_log" in n or "alpha" in n:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def _entries(cache):
    out = []
    for i, d in enumerate(cache.layers):
        for name, lc in d.items():
            for k in sorted(lc):
                v = lc[k]
                vals = v if isinstance(v, tuple) else (v,)
                out += [(f"{i}.{name}.{k}", t) for t in vals if isinstance(t, torch.Tensor)]
                if not isinstance(v, (tuple, torch.Tensor)):
                    out.append((f"{i}.{name}.{k}", torch.tensor(v)))
    return out


def _assert_entries(a, b, tol=None):
    """Same keys, dtypes and shapes; values bit for bit (tol None) or to tol."""
    ea, eb = _entries(a), _entries(b)
    assert [k for k, _ in ea] == [k for k, _ in eb]
    for (k, x), (_, y) in zip(ea, eb):
        assert x.dtype == y.dtype and x.shape == y.shape, k
        if tol is None:
            assert torch.equal(x, y), k
        else:
            torch.testing.assert_close(x, y, rtol=tol, atol=tol, msg=k)
    assert a.seen_tokens == b.seen_tokens


def _ids(B, T, seed):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("mixer", MIXERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("batch", [1, 3])
def test_model_step_equals_block_step_torch_step_and_forward(mixer, dtype, batch, monkeypatch):
    """Prefill 4 then 10 decoded tokens: the states, windows and offsets bit for bit as the per-block compiled
    step's, the logits to rounding; logits and entries as the PyTorch step's; logits as the full forward's."""
    model = _model(mixer, dtype)
    ids = _ids(batch, 14, 1)
    count = ModelCount(monkeypatch)
    got, cache = decode_tokens(model, ids)
    assert (count.model, count.block) == (10, 0)
    ref, ref_cache = decode_tokens(block_decode_twin(model), ids)
    assert (count.model, count.block) == (10, 2 * 10)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    _assert_entries(cache, ref_cache)
    tch, tch_cache = decode_tokens(torch_decode_twin(model), ids)
    assert count.model == 10
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(got, tch, rtol=tol, atol=tol)
    _assert_entries(cache, tch_cache, tol)
    with torch.no_grad():
        full = model(ids).logits
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(got, full, rtol=tol, atol=tol)


@pytest.mark.parametrize("kw", [dict(mixer=["gated-deltanet", "linear-elu+1", "efla"], layers=3),
                                dict(mixer="gated-deltanet", n_value_heads=4),
                                dict(mixer="efla", ffn="none", final_norm=False),
                                dict(mixer="linear-elu+1", tie_embeddings=False)])
@pytest.mark.parametrize("batch", [1, 2])
def test_model_step_mixed_layers_grouped_heads_no_ffn(kw, batch, monkeypatch):
    """Layers of different kinds and state shapes (one buffer, per-layer views), grouped value heads (q | k | v
    windows of different widths), no FFN and no final norm, an untied head: the per-block step's values; the
    first token from an empty cache too."""
    kw = dict(kw)
    model = _model(kw.pop("mixer"), layers=kw.pop("layers", 2), **kw)
    ids = _ids(batch, 9, 2)
    count = ModelCount(monkeypatch)
    for prefill in (0, 3):
        got, cache = decode_tokens(model, ids, prefill)
        ref, ref_cache = decode_tokens(block_decode_twin(model), ids, prefill)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        _assert_entries(cache, ref_cache)
    assert count.model == 9 + 6


def test_hybrid_with_softmax_takes_the_model_step(monkeypatch):
    """A hybrid with a softmax layer decodes in the whole-model step (tests/models/test_decode_plan_softmax.py); block
    by block (`compiled_decode = False`) the softmax layer has no compiled block step and the covered layers take
    the per-block one; the values are the PyTorch step's either way."""
    model = _model(["gated-deltanet", "softmax"])
    ids = _ids(2, 10, 3)
    count = ModelCount(monkeypatch)
    got, _ = decode_tokens(model, ids)
    assert (count.model, count.block) == (6, 0)
    model.compiled_decode = False
    got_blocks, _ = decode_tokens(model, ids)
    assert (count.model, count.block) == (6, 6)
    ref, _ = decode_tokens(torch_decode_twin(model), ids)
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(got_blocks, ref, rtol=2e-5, atol=2e-5)


def test_earlier_states_copies_and_beams_are_not_corrupted(monkeypatch):
    """The step writes fresh buffers: a state held from before a step keeps its values, a deepcopy and a snapshot
    of the cache continue independently, and reorder (beam search) then decoding gives the per-block step's
    values."""
    model = _model("gated-deltanet")
    twin = block_decode_twin(model)
    ids = _ids(3, 12, 4)
    count = ModelCount(monkeypatch)
    _, cache = decode_tokens(model, ids[:, :6])
    _, ref_cache = decode_tokens(twin, ids[:, :6])
    held = [t for _, t in _entries(cache)]
    before = [t.clone() for t in held]
    copied, snap = copy.deepcopy(cache), cache.snapshot()
    got, _ = decode_tokens(model, ids[:, 6:9], prefill=0, cache=cache)
    assert all(torch.equal(t, u) for t, u in zip(held, before))
    got_copy, _ = decode_tokens(model, ids[:, 6:9], prefill=0, cache=copied)
    torch.testing.assert_close(got_copy, got, rtol=0, atol=0)
    cache.restore(snap)
    got_again, _ = decode_tokens(model, ids[:, 6:9], prefill=0, cache=cache)
    torch.testing.assert_close(got_again, got, rtol=0, atol=0)
    beams = torch.tensor([2, 0, 0])
    cache.reorder(beams)
    decode_tokens(twin, ids[:, 6:9], prefill=0, cache=ref_cache)
    ref_cache.reorder(beams)
    got, _ = decode_tokens(model, ids[:, 9:], prefill=0, cache=cache)
    ref, _ = decode_tokens(twin, ids[:, 9:], prefill=0, cache=ref_cache)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    _assert_entries(cache, ref_cache)
    assert count.model == 2 + 4 * 3


def test_nan_reaches_only_later_tokens(monkeypatch):
    """A NaN embedding at position 6: earlier logits unchanged to the bit, the NaN pattern as the per-block and
    the PyTorch steps', every later logit NaN."""
    model = _model("efla")
    ids = _ids(1, 10, 5)
    ids[0, :6] = torch.where(ids[0, :6] == ids[0, 6], (ids[0, 6] + 1) % VOCAB, ids[0, :6])
    clean, _ = decode_tokens(model, ids)
    with torch.no_grad():
        model.embed.weight[ids[0, 6]] = float("nan")
    count = ModelCount(monkeypatch)
    got, _ = decode_tokens(model, ids)
    assert count.model == 6
    keep = torch.arange(VOCAB) != ids[0, 6]   # the tied head's row of the poisoned token is NaN everywhere
    assert torch.equal(got[:, :6, keep], clean[:, :6, keep])
    for twin in (block_decode_twin(model), torch_decode_twin(model)):
        ref, _ = decode_tokens(twin, ids)
        assert torch.equal(torch.isnan(got), torch.isnan(ref))
    assert torch.isnan(got[:, 6:]).all()


def test_switches_hooks_autograd_and_rollback_take_the_other_paths(monkeypatch):
    """LINATTN_CPU_KERNELS=0, model.compiled_decode = False, a layer's compiled_decode / fast_decode = False, a hook
    on any module (or a global one), autograd and a rollback cache: no whole-model call, same logits."""
    import torch.nn as nn
    model = _model("gated-deltanet")
    ids = _ids(1, 7, 6)
    ref, _ = decode_tokens(torch_decode_twin(model), ids)
    count = ModelCount(monkeypatch)

    def check(expect_model, expect_block):
        count.model = count.block = 0
        got, _ = decode_tokens(model, ids)
        torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)
        assert (count.model, count.block) == (expect_model, expect_block)

    check(3, 0)
    monkeypatch.setenv("LINATTN_CPU_KERNELS", "0")
    check(0, 0)
    monkeypatch.delenv("LINATTN_CPU_KERNELS")
    model.compiled_decode = False
    check(0, 6)
    model.compiled_decode = True
    for attr in ("compiled_decode", "fast_decode"):
        setattr(model.blocks[1].mixer, attr, False)
        check(0, 3)
        setattr(model.blocks[1].mixer, attr, True)
    # a hook anywhere stops the model step; the per-block step then skips the blocks whose modules it calls
    for m, blocks in ((model.blocks[0], 6), (model.blocks[0].mixer, 3), (model.blocks[1].ffn.w_down, 3),
                      (model.norm, 6), (model.embed, 6)):
        calls = []
        h = m.register_forward_pre_hook(lambda *a: calls.append(1))
        check(0, blocks)
        assert len(calls) == 4   # the prefill and 3 decoded tokens
        h.remove()
    h = nn.modules.module.register_module_forward_hook(lambda *a: None)
    check(0, 0)
    h.remove()
    check(3, 0)
    count.model = 0
    out = model(ids[:, :3], use_cache=True)    # grad enabled: the general path
    model(ids[:, 3:4], cache=out.cache).logits.sum().backward()
    assert model.blocks[0].mixer.q_proj.weight.grad is not None and count.model == 0
    with torch.no_grad():
        cache = model.new_cache(rollback=2)
        model(ids[:, :3], cache=cache)
        model(ids[:, 3:4], cache=cache)
        cache.crop(3)
    assert count.model == 0


def test_plan_follows_updates_replacements_batch_and_dtype(monkeypatch):
    """In-place updates of any weight (an optimizer step), a parameter or submodule replaced, `.data` swapped, a new
    batch size, a deepcopy, the model moved to fp64 mid-generation: the plan is rebuilt and the values stay the
    PyTorch step's."""
    import torch.nn as nn
    model = _model("linear-elu+1")
    ids = _ids(2, 8, 7)
    count = ModelCount(monkeypatch)

    def check(m=model, batch=ids):
        got, _ = decode_tokens(m, batch)
        ref, _ = decode_tokens(torch_decode_twin(m), batch)
        torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)

    check()
    with torch.no_grad():
        for name in ("blocks.0.ffn.w_down.weight", "blocks.1.norm1.weight", "blocks.0.mixer.o_proj.weight",
                     "blocks.1.mixer.q_proj.weight", "embed.weight", "norm.weight"):
            dict(model.named_parameters())[name].mul_(1.5)
    check()
    model.blocks[0].mixer.k_proj.weight = nn.Parameter(torch.randn_like(model.blocks[0].mixer.k_proj.weight))
    check()
    model.blocks[1].mixer.v_proj.weight.data = torch.randn_like(model.blocks[1].mixer.v_proj.weight)
    check()
    model.blocks[1].ffn.w_gate_up = nn.Linear(32, model.blocks[1].ffn.w_gate_up.out_features, bias=False)
    check()
    check(batch=ids[:1])
    check(m=copy.deepcopy(model))
    assert count.model == 7 * 4
    for mixer in ("gated-deltanet", "linear-elu+1"):
        outs = []
        for m in (_model(mixer), torch_decode_twin(_model(mixer))):
            with torch.no_grad():
                out = m(ids[:, :4], use_cache=True)
                logits = [m(ids[:, t:t + 1], cache=out.cache).logits for t in range(4, 6)]
                m.double()
                logits += [m(ids[:, t:t + 1], cache=out.cache).logits.float() for t in range(6, 8)]
            outs.append(torch.cat(logits, 1))
        torch.testing.assert_close(outs[0], outs[1], rtol=2e-5, atol=2e-5)
    assert count.model == 7 * 4 + 2 * 4


def test_ids_logits_to_keep_and_generate(monkeypatch):
    """Out-of-range ids raise forward's error (the cache untouched), int32 ids and logits_to_keep give the same
    logits, and generate() decodes through the model step."""
    model = _model("gated-deltanet")
    ids = _ids(2, 6, 8)
    count = ModelCount(monkeypatch)
    _, cache = decode_tokens(model, ids)
    entries = [t.clone() for _, t in _entries(cache)]
    with torch.no_grad():
        with pytest.raises(LinattnError, match="vocab_size"):
            model(torch.tensor([[1], [VOCAB]]), cache=cache)
        assert all(torch.equal(t, u) for (_, t), u in zip(_entries(cache), entries))
        snap = cache.snapshot()
        a = model(ids[:, 5:6], cache=cache).logits
        for keep in (1, 3):
            cache.restore(snap)
            assert torch.equal(model(ids[:, 5:6], cache=cache, logits_to_keep=keep).logits, a)
        cache.restore(snap)
        assert torch.equal(model(ids[:, 5:6].int(), cache=cache).logits, a)
    n = count.model
    model.generate(ids[0, :3], 4, temperature=0)
    assert count.model == n + 3   # (the greedy loop: the first token from the prefill, then 3 steps, none after)


def test_bench_decode_all_names_the_block_twin(tmp_path, monkeypatch):
    """`bench decode --decode-step all` times each mixer with the whole-model step, its <mixer>+block twin (one
    compiled call per block) and its <mixer>+torch twin."""
    import json

    from linattn.cli import main

    count = ModelCount(monkeypatch)
    rc = main(["bench", "decode", "--N", "16", "--mixers", "softmax,gated-deltanet", "--bandwidth-mib", "16",
               "--d-model", "16",
               "--n-heads", "2", "--n-layers", "1", "--vocab-size", "40", "--decode-steps", "2",
               "--decode-step", "all", "--out", str(tmp_path), "--quiet"])
    assert rc == 0
    models = {r["model"] for r in json.loads((tmp_path / "decode.json").read_text())["records"]}
    assert models == {"softmax", "gated-deltanet", "gated-deltanet+block", "gated-deltanet+torch"}
    assert count.model > 0 and count.block > 0


def test_pending_tokens_copies_pickles_and_readers(monkeypatch):
    """Tokens decoded with nothing reading the cache in between are kept pending (`Cache.pending`, no entries
    written); every way of reading or copying the cache sees the entries the per-block step writes: `layers`,
    `layer()`, a deepcopy or a pickle taken while tokens are pending (each continues on its own, as the original
    does), `nbytes`, `snapshot`; `restore` drops pending tokens."""
    import pickle

    model = _model("linear-elu+1")
    ids = _ids(2, 14, 9)
    count = ModelCount(monkeypatch)
    _, ref_cache = decode_tokens(block_decode_twin(model), ids)
    with torch.no_grad():
        cache = model(ids[:, :4], use_cache=True).cache
        for t in range(4, 8):
            aux = model(ids[:, t:t + 1], cache=cache).aux_loss   # written by the C call
            assert aux.dtype == torch.float32 and aux.shape == () and aux.item() == 0.0
        assert cache.pending is not None and cache.pending.n == 4 and cache.seen_tokens == 8
        copied, pickled = copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))
        snap_ids = ids[:, 8:]
        outs = []
        for c in (cache, copied, pickled):
            outs.append(torch.cat([model(snap_ids[:, t:t + 1], cache=c).logits for t in range(snap_ids.shape[1])], 1))
            assert c.pending is not None and c.pending.n == 10
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
        for c in (cache, copied, pickled):
            _assert_entries(c, ref_cache)
            assert c.pending is None
        assert count.model == 4 + 3 * 6
        # readers between tokens: the entries after each token as the per-block step's
        cache = model(ids[:, :4], use_cache=True).cache
        ref = block_decode_twin(model)(ids[:, :4], use_cache=True).cache
        twin = block_decode_twin(model)
        for t in range(4, 7):
            model(ids[:, t:t + 1], cache=cache)
            twin(ids[:, t:t + 1], cache=ref)
            assert cache.layer(1, "mixer")["offset"] == ref.layer(1, "mixer")["offset"] == t + 1
            assert torch.equal(cache.layer(0, "mixer")["state"].kv, ref.layer(0, "mixer")["state"].kv)
            assert cache.nbytes() == ref.nbytes()
        snap = cache.snapshot()
        model(ids[:, 7:8], cache=cache)
        assert cache.pending is not None
        cache.restore(snap)
        assert cache.pending is None and cache.seen_tokens == 7
        _assert_entries(cache, ref)
    state = cache.__getstate__() if hasattr(cache, "__getstate__") else dict(cache.__dict__)
    state = dict(state)
    state["layers"] = state.pop("_layers")   # a cache pickled before `layers` was a property
    old = type(cache).__new__(type(cache))
    old.__setstate__(state)
    _assert_entries(old, ref)


def test_switch_read_per_token_follows_the_environment(monkeypatch):
    """`switched_on` (the per-token read of LINATTN_CPU_KERNELS) agrees with `build.enabled` through every change of
    the variable, unset included."""
    from linattn.cpu.build import enabled

    for value in ("0", "1", " OFF ", "no", "yes", "False", "", "0"):
        monkeypatch.setenv("LINATTN_CPU_KERNELS", value)
        assert cpu_decode.switched_on() == enabled() == (value.strip().lower() not in ("0", "false", "off", "no"))
    monkeypatch.delenv("LINATTN_CPU_KERNELS")
    assert cpu_decode.switched_on() and enabled()
