"""Shared checks of the compiled decode's block kinds without a per-layer fast step (KDA, Mamba2): a hybrid model in
which such layers sit beside Gated DeltaNet and softmax layers, decoded by the whole-model plan, by the per-block
plans and by the per-block PyTorch path, compared against that PyTorch path in fp64."""
import copy

import torch

from linattn.models import LanguageModel, LMConfig
from tests.helpers import CompiledDecodeCalls, dequantized_fp64, torch_decode_twin

VOCAB = 61
EPS = {torch.float32: 2.0 ** -23, torch.float64: 2.0 ** -52, torch.bfloat16: 2.0 ** -8}


def hybrid(kind: str, dtype=torch.float32, kw=None, pattern=(0, 1, 0, 2), d_model=32, ffn_hidden=48, n_heads=2):
    """A LanguageModel whose layers follow `pattern` (0: `kind` with options kw, 1: Gated DeltaNet, 2: softmax),
    norms, biases and decays moved off their initial values so that each of them matters."""
    torch.manual_seed(0)
    names = {0: kind, 1: "gated-deltanet", 2: "softmax"}
    mixers = [names[i] for i in pattern]
    mk = {kind: dict(kw or {}), "softmax": dict(heads=4, n_kv_heads=2, head_dim=16, output_gate=True, kv_chunk=4)}
    cfg = LMConfig(vocab_size=VOCAB, d_model=d_model, n_layers=len(pattern), n_heads=n_heads, head_dim=16, mixer=mixers,
                   ffn_hidden=ffn_hidden, mixer_kwargs=mk)
    model = LanguageModel(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n or "A_log" in n or n.endswith(".D"):
                p.add_(0.1 * torch.randn_like(p))
        model.embed.weight.mul_(3)   # logits of a few units: greedy ties are rare
    return model.to(dtype).eval()


def ids_of(B, T, seed=1):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def decode(model, ids, prefill):
    """Logits of the prefill's last token and of every later token decoded one at a time; the cache."""
    with torch.no_grad():
        out = model(ids[:, :prefill], use_cache=True)
        cache, logits = out.cache, [out.logits[:, -1:]]
        for t in range(prefill, ids.shape[1]):
            logits.append(model(ids[:, t:t + 1], cache=cache).logits)
    return torch.cat(logits, 1), cache


def pytorch_twin(model, dtype=None):
    """The model with every compiled step off (the per-block PyTorch path), in dtype."""
    twin = torch_decode_twin(model, dtype)
    twin.compiled_decode = False
    return twin


def assert_within_bound(got, ref64, twin_err, dtype):
    """|got - ref64| <= 4 * the per-block path's own error + a few ulps of the logits' scale."""
    err = (got.double() - ref64).abs().max().item()
    allowed = 4 * twin_err + 16 * EPS[dtype] * ref64.abs().max().item()
    assert err <= allowed, (err, allowed, twin_err)


def check_one_call_per_token(model, dtype, B, prefill, monkeypatch, layers):
    """Every decoded token is one compiled whole-model call; the logits are within 4x the per-block PyTorch path's
    own error of the fp64 reference, the greedy tokens agree with that path's (fp32 / fp64), and the cache entries
    of `layers` (state, conv windows, offsets) are that path's."""
    twin, ref = pytorch_twin(model), pytorch_twin(model, torch.float64)
    ids = ids_of(B, prefill + 9)
    calls = CompiledDecodeCalls(monkeypatch)
    got, cache = decode(model, ids, prefill)
    n, blocks = ids.shape[1] - prefill, calls.block   # (a one-token prompt runs the per-block plans)
    assert calls.model == n
    want, tcache = decode(twin, ids, prefill)
    ref64, _ = decode(ref, ids, prefill)
    assert (calls.model, calls.block) == (n, blocks)   # (the twins take the PyTorch path)
    assert_within_bound(got, ref64, (want.double() - ref64).abs().max().item(), dtype)
    if dtype != torch.bfloat16:
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        assert_same_entries(cache, tcache, layers, 1e-4 if dtype == torch.float32 else 1e-10)


def _flat_fields(lc):
    """A LayerCache's state fields by name, its conv windows and extra entries one level down ("conv.q")."""
    out = {}
    for name, v in lc.state_fields().items():
        out.update({f"{name}.{k}": t for k, t in v.items()} if isinstance(v, dict) else {name: v})
    return out


def assert_same_entries(cache, tcache, layers, tol):
    for i in layers:
        a, b = cache.layer(i, "mixer"), tcache.layer(i, "mixer")
        assert int(a.offset) == int(b.offset), i
        a, b = _flat_fields(a), _flat_fields(b)
        assert set(a) == set(b), (i, set(a), set(b))
        for key in a:
            x, y = a[key], b[key]
            xs, ys = (tuple(x) if isinstance(x, tuple) else (x,)), (tuple(y) if isinstance(y, tuple) else (y,))
            for u, v in zip(xs, ys):
                if u is None or v is None:
                    assert u is None and v is None, (i, key)
                    continue
                assert u.shape == v.shape, (i, key, u.shape, v.shape)
                torch.testing.assert_close(u.double(), v.double(), rtol=tol, atol=tol)


def check_handoff(model, monkeypatch, kind_layers):
    """Tokens decoded by the whole-model plan, the per-block plans and the PyTorch path in turn on one cache (each
    continuing what another wrote): the PyTorch path's logits throughout, and every path ran."""
    twin = pytorch_twin(model)
    ids = ids_of(2, 14)
    calls = CompiledDecodeCalls(monkeypatch)
    mixers = [model.blocks[i].mixer for i in kind_layers]
    with torch.no_grad():
        cache, tcache = model(ids[:, :3], use_cache=True).cache, twin(ids[:, :3], use_cache=True).cache
        for t in range(3, 14):
            phase = t % 3   # 0: whole-model plan, 1: per-block plans, 2: the PyTorch path for these layers
            model.compiled_decode = phase == 0
            for m in mixers:
                m.compiled_decode = phase != 2
            got, want = model(ids[:, t:t + 1], cache=cache).logits, twin(ids[:, t:t + 1], cache=tcache).logits
            torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    assert calls.model > 0 and calls.block > 0
    for m in mixers:
        m.compiled_decode = True
    model.compiled_decode = True


def check_guard(model, change, monkeypatch):
    """A change the plan depends on invalidates its guard; decoding after it gives the PyTorch path's logits."""
    ids = ids_of(2, 8)
    decode(model, ids, 3)
    guard = model._model_plan.guard
    assert guard.valid()
    change(model)
    assert not guard.valid()
    calls = CompiledDecodeCalls(monkeypatch)
    got, _ = decode(model, ids, 3)
    want, _ = decode(pytorch_twin(model), ids, 3)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    return calls


def check_quantized(qmodel, monkeypatch):
    """The compiled decode of a quantized model (one call per token) vs its dequantized weights in fp64, within 4x
    PyTorch's own fp32 error on those weights."""
    ids = ids_of(2, 10)
    calls = CompiledDecodeCalls(monkeypatch)
    got, _ = decode(qmodel, ids, 3)
    assert (calls.model, calls.block) == (7, 0)
    ref, _ = decode(pytorch_twin(dequantized_fp64(qmodel)), ids, 3)
    fp32, _ = decode(pytorch_twin(dequantized_fp64(qmodel).float()), ids, 3)
    assert_within_bound(got, ref, (fp32.double() - ref).abs().max().item(), torch.float32)


def check_generate(model):
    """`generate`, greedy and sampled with a seed: the PyTorch path's tokens."""
    twin = pytorch_twin(model)
    prompt = ids_of(1, 4)[0]
    for kw in (dict(temperature=0.0), dict(temperature=0.8, top_k=20, generator=5)):
        assert torch.equal(model.generate(prompt, 12, **kw), twin.generate(prompt, 12, **kw))


def check_nan_token(model):
    """A NaN token (its embedding row) decoded in row 0: row 0's logits from then on are NaN, row 1's are finite and
    the PyTorch path's for row 1 alone (whose general path refuses NaN gates rather than propagating them)."""
    ids = ids_of(2, 7)
    bad = int(ids[0, 4])
    with torch.no_grad():
        model.embed.weight[bad] = float("nan")
    ids[1][ids[1] == bad] = (bad + 1) % VOCAB
    ids[0, :4][ids[0, :4] == bad] = (bad + 1) % VOCAB
    got, _ = decode(model, ids, 3)
    want, _ = decode(pytorch_twin(model), ids[1:], 3)
    keep = torch.arange(VOCAB) != bad   # (a tied head: the NaN row is that token's logit everywhere)
    got, want = got[..., keep], want[..., keep]
    assert got[0, 2:].isnan().all()
    assert not got[:, :2].isnan().any() and not got[1].isnan().any()
    torch.testing.assert_close(got[1], want[0], rtol=1e-10, atol=1e-10)


CACHE_OPS = ["deepcopy", "reorder", "snapshot-restore", "remove rows"]


def check_cache_op(model, op, monkeypatch):
    """A cache copied, reordered, snapshot and restored, or left by rows between compiled tokens: the PyTorch
    path's logits after it, every token still one compiled call, and a copy's decoding never changes the original."""
    twin = pytorch_twin(model)
    ids = ids_of(3, 10)
    calls = CompiledDecodeCalls(monkeypatch)
    with torch.no_grad():
        caches = [m(ids[:, :4], use_cache=True).cache for m in (model, twin)]
        for m, c in zip((model, twin), caches):
            m(ids[:, 4:5], cache=c)
        tok = ids[:, 5:6]
        originals = caches
        if op == "deepcopy":
            before = copy.deepcopy(originals[0].layer(0, "mixer"))
            caches = [copy.deepcopy(c) for c in caches]
        elif op == "reorder":
            for c in caches:
                c.reorder(torch.tensor([2, 0, 0, 1]))
            tok = tok[[2, 0, 0, 1]]
        elif op == "snapshot-restore":
            snaps = [c.snapshot() for c in caches]
            for m, c in zip((model, twin), caches):
                m(tok, cache=c)
                m(tok, cache=c)
            for c, s in zip(caches, snaps):
                c.restore(s)
        else:
            for c in caches:
                c.remove_rows([1])
            tok = tok[[0, 2]]
        n0 = calls.model
        for _ in range(4):
            outs = [m(tok, cache=c).logits for m, c in zip((model, twin), caches)]
            torch.testing.assert_close(outs[0], outs[1], rtol=2e-5, atol=2e-5)
            tok = outs[1].argmax(-1)
        assert calls.model == n0 + 4
    if op == "deepcopy":   # the original's entries: as before the copies decoded
        after = _flat_fields(originals[0].layer(0, "mixer"))
        assert int(originals[0].layer(0, "mixer").offset) == int(before.offset)
        for key, value in _flat_fields(before).items():
            x, y = after[key], value
            xs, ys = (tuple(x) if isinstance(x, tuple) else (x,)), (tuple(y) if isinstance(y, tuple) else (y,))
            for u, v in zip(xs, ys):
                assert (u is None and v is None) or torch.equal(torch.as_tensor(u), torch.as_tensor(v)), key


def check_threads(model):
    """At 2 threads the heads (and the big products' rows) split over the threads: the same logits, bit for bit, as
    at 1 thread (each item's arithmetic is the same); the plan is rebuilt for the thread count."""
    ids = ids_of(4, 6)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = decode(model, ids, 2)
        torch.set_num_threads(2)
        two, _ = decode(model, ids, 2)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, two)


def assert_matches_twin(model, ids, prefill, tol=2e-5):
    """The model's decoded logits are its PyTorch twin's within tol."""
    got, _ = decode(model, ids, prefill)
    want, _ = decode(pytorch_twin(model), ids, prefill)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def check_block_plans_alone(model, monkeypatch):
    """`compiled_decode = False` on the model (pattern (0, 1, 0, 2)): every non-softmax block is its own compiled
    call per token (the softmax block has the whole-model step only), with the PyTorch path's logits."""
    model.compiled_decode = False
    calls = CompiledDecodeCalls(monkeypatch)
    ids = ids_of(3, 9)
    assert_matches_twin(model, ids, 3)
    assert calls.model == 0 and calls.block == 6 * 3


def check_steps_aside(model, monkeypatch):
    """A model the compiled step does not cover decodes on the per-block PyTorch path (no compiled whole-model
    call), with the twin's logits."""
    calls = CompiledDecodeCalls(monkeypatch)
    assert_matches_twin(model, ids_of(2, 7), 3)
    assert calls.model == 0


def check_update_in_place_without_rebuild(model, update):
    """Weights the plan reads in place: `update(model)` in place between two tokens of one cache is seen at once,
    without a rebuild of the plan (the twin, updated alike, gives the same logits)."""
    from linattn.models import decode_plan

    twin = pytorch_twin(model)
    ids = ids_of(2, 8)
    with torch.no_grad():
        caches = [m(ids[:, :3], use_cache=True).cache for m in (model, twin)]
        for m, c in zip((model, twin), caches):
            m(ids[:, 3:4], cache=c)
        built = decode_plan.rebuilds[0]
        for m in (model, twin):
            update(m)
        for t in range(4, 8):
            got, want = (m(ids[:, t:t + 1], cache=c).logits for m, c in zip((model, twin), caches))
            torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    assert decode_plan.rebuilds[0] == built
