"""The decode plan (models/decode_plan.py): one guard (`PlanGuard`) with a test per invalidation cause, a change of
batch size without a rebuild, and a plan built from a description of blocks that a model other than
`LanguageModel` gives."""
import pytest
import torch
import torch.nn as nn

from linattn.cpu import decode as cpu_decode
from linattn.layers import RMSNorm, SwiGLU
from linattn.models import LanguageModel, LMConfig, decode_plan
from linattn.models.registry import build_mixer
from tests.helpers import CompiledDecodeCalls, torch_decode_twin

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler: the compiled kernels are off")
VOCAB = 40


def _model(mixer="gated-deltanet", dtype=torch.float32, **kw):
    torch.manual_seed(0)
    model = LanguageModel(LMConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2, mixer=mixer, **kw)).to(dtype)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n or "A_log" in n:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def _ids(B, T=7, seed=1):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def _generate(model, ids, prefill=3):
    with torch.no_grad():
        out = model(ids[:, :prefill], use_cache=True)
        cache, logits = out.cache, [out.logits]
        for t in range(prefill, ids.shape[1]):
            logits.append(model(ids[:, t:t + 1], cache=cache).logits)
    return torch.cat(logits, 1)


def _set_bias(model):
    lin = model.blocks[0].ffn.w_gate_up
    lin.bias = nn.Parameter(0.1 * torch.randn(lin.out_features))


def _replace_submodule(model):
    old = model.blocks[1].mixer.o_proj
    new = nn.Linear(old.in_features, old.out_features, bias=False)
    with torch.no_grad():
        new.weight.copy_(old.weight * 0.5)
    model.blocks[1].mixer.o_proj = new


def _replace_parameter(model):
    m = model.blocks[0].ffn.w_down
    m.weight = nn.Parameter(m.weight.detach() * 1.5)


def _swap_data(model):
    p = model.blocks[0].norm1.weight
    p.data = p.data * 2


def _in_place_copied(model):
    with torch.no_grad():
        model.blocks[0].mixer.k_conv.weight.mul_(1.3)   # read through the fused conv weights (a copy)


def _write_through_data(model):
    model.blocks[1].mixer.q_conv.weight.data.mul_(0.7)   # no version bump: new_cache clears the fused weights
    model.new_cache()


def _config_value(model):
    model.blocks[0].mixer.scale = 0.25


def _switch_off(model):
    model.blocks[1].mixer.compiled_decode = False


def _hook(model):
    model.blocks[1].ffn.register_forward_hook(lambda *a: None)


def _dtype(model):
    model.double()


def _training(model):
    model.train()


CAUSES = {"a parameter set where there was None": _set_bias, "a replaced submodule": _replace_submodule,
          "a replaced parameter": _replace_parameter, "a swapped .data": _swap_data,
          "an in-place update of a copied weight": _in_place_copied,
          "a write through .data, then new_cache": _write_through_data, "a configuration value": _config_value,
          "a switch": _switch_off, "a hook": _hook, "a dtype change": _dtype, "train mode": _training}


@pytest.mark.parametrize("cause", list(CAUSES))
def test_guard_invalidates_for_each_cause(cause):
    """Each change that the plan depends on makes its guard invalid; decoding after it gives the PyTorch step's
    logits (the plan rebuilt, or the usual path where the model no longer qualifies)."""
    model = _model()
    ids = _ids(1)
    _generate(model, ids)
    guard = model._model_plan.guard
    assert guard.valid()
    CAUSES[cause](model)
    assert not guard.valid()
    model.eval()   # (train mode: the guard saw it; decode in eval as the reference)
    ref = _generate(torch_decode_twin(model), ids)
    got = _generate(model, ids)
    tol = 1e-12 if got.dtype == torch.float64 else 2e-5
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


def test_guard_invalidates_for_a_global_hook_and_the_thread_count():
    model = _model()
    _generate(model, _ids(1))
    guard = model._model_plan.guard
    h = nn.modules.module.register_module_forward_pre_hook(lambda *a: None)
    assert not guard.valid()
    h.remove()
    assert guard.valid()
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(n + 1)
        assert not guard.valid()
    finally:
        torch.set_num_threads(n)
    assert guard.valid()


def test_unchanged_model_keeps_its_plan_and_an_in_place_update_of_a_direct_weight_is_read():
    """No rebuild between tokens; a weight the plan reads in place (o_proj; k_proj, a part of the fused input
    projection; w_gate_up) updated in place needs no rebuild either, and the next token reads the new values. (A new
    cache clears the fused weights: `new_cache`.)"""
    model = _model()
    ids = _ids(1, T=6)
    twin = torch_decode_twin(model)
    with torch.no_grad():
        cache, ref_cache = model(ids[:, :2], use_cache=True).cache, twin(ids[:, :2], use_cache=True).cache
        model(ids[:, 2:3], cache=cache)
        twin(ids[:, 2:3], cache=ref_cache)
        built = decode_plan.rebuilds[0]
        for t in range(3, 6):
            if t == 4:
                for m in (model, twin):
                    m.blocks[0].mixer.o_proj.weight.mul_(1.5)
            if t == 5:
                for m in (model, twin):
                    m.blocks[1].mixer.k_proj.weight.mul_(0.8)
                    m.blocks[1].ffn.w_gate_up.weight.mul_(1.2)
            got, ref = model(ids[:, t:t + 1], cache=cache).logits, twin(ids[:, t:t + 1], cache=ref_cache).logits
            torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)
    assert decode_plan.rebuilds[0] == built


@pytest.mark.parametrize("mixer", ["gated-deltanet", "linear-elu+1"])
@pytest.mark.parametrize("per_block", [False, True])
def test_batch_change_needs_no_rebuild(mixer, per_block, monkeypatch):
    """A server's batch changes every step (requests finish, others are repeated / forked: `Cache.reorder`): 3, 2,
    4, 1, 3 rows decode through the same plans (no rebuild), each step with the PyTorch step's logits, on the
    whole-model step and on the per-block one."""
    model = _model(mixer)
    model.compiled_decode = not per_block
    twin = torch_decode_twin(model)
    calls = CompiledDecodeCalls(monkeypatch)
    ids = _ids(3, T=4)
    rows = [torch.tensor(r) for r in ([0, 2], [1, 1, 0, 0], [2], [0, 0, 0])]
    with torch.no_grad():
        cache, ref_cache = model(ids, use_cache=True).cache, twin(ids, use_cache=True).cache
        tok = ids[:, -1:]
        model(tok, cache=cache)
        twin(tok, cache=ref_cache)
        built = decode_plan.rebuilds[0]
        for r in rows:
            cache.reorder(r)
            ref_cache.reorder(r)
            tok = tok[r]
            got, ref = model(tok, cache=cache).logits, twin(tok, cache=ref_cache).logits
            torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)
            tok = ref.argmax(-1)
    assert decode_plan.rebuilds[0] == built
    assert calls.model == (0 if per_block else 5)


class _OtherModel(nn.Module):
    """Not a LanguageModel: its own module names and forward, and a `decode_description` of its blocks."""

    def __init__(self, d=32, hidden=48):
        super().__init__()
        torch.manual_seed(3)
        self.tok = nn.Embedding(VOCAB, d)
        self.mixers = nn.ModuleList([build_mixer("gated-deltanet", d, 2) for _ in range(2)])
        self.pre = nn.ModuleList([RMSNorm(d) for _ in range(2)])
        self.post = nn.ModuleList([RMSNorm(d) for _ in range(2)])
        self.mlps = nn.ModuleList([SwiGLU(d, hidden) for _ in range(2)])
        self.out_norm = RMSNorm(d)
        self.out = nn.Linear(d, VOCAB, bias=False)
        with torch.no_grad():
            for n in (*self.pre, *self.post, self.out_norm):
                n.weight.add_(0.1 * torch.randn_like(n.weight))

    def forward(self, ids, cache):
        x = self.tok(ids)
        for i, (mixer, n1, n2, mlp) in enumerate(zip(self.mixers, self.pre, self.post, self.mlps)):
            h = x + mixer(n1(x), cache=cache.layer(i, "mixer"))
            x = h + mlp(n2(h))
        return self.out(self.out_norm(x))

    def decode_description(self):
        blocks = [decode_plan.BlockDescription(m, m.fast_step_kind(), n1, n2, "swiglu", f.w_gate_up, f.w_down,
                                               modules=(n1, n2, f, f.w_gate_up, f.w_down))
                  for m, n1, n2, f in zip(self.mixers, self.pre, self.post, self.mlps)]
        return decode_plan.ModelDescription(self.tok, blocks, self.out_norm, self.out)


def test_plan_built_from_a_description_of_another_model(monkeypatch):
    """A model that is not a LanguageModel describes its blocks and decodes through the same compiled call, with
    the logits and states of its own forward."""
    from linattn.layers import Cache
    model = _OtherModel().eval()
    calls = CompiledDecodeCalls(monkeypatch)
    ids = _ids(2, T=6)
    with torch.no_grad():
        ref_cache, fast_cache = Cache(2), Cache(2)
        ref = torch.cat([model(ids[:, t:t + 1], ref_cache) for t in range(6)], 1)
        got = [decode_plan.model_step(model, ids[:, t:t + 1], fast_cache, 0) for t in range(6)]
    assert all(g is not None for g in got) and calls.model == 6
    torch.testing.assert_close(torch.cat([g[0] for g in got], 1), ref, rtol=2e-5, atol=2e-5)
    for i in range(2):
        torch.testing.assert_close(fast_cache.layer(i, "mixer").state, ref_cache.layer(i, "mixer").state,
                                   rtol=2e-5, atol=2e-5)
    other = _OtherModel().eval()
    other.decode_description = lambda: None   # a model that cannot describe itself: no compiled call
    parallel = _OtherModel().eval()
    desc = parallel.decode_description()
    desc.blocks[1].residual = "parallel"      # a residual order the compiled block does not compute
    parallel.decode_description = lambda: desc
    with torch.no_grad():
        assert decode_plan.model_step(other, ids[:, :1], Cache(2), 0) is None
        assert decode_plan.model_step(parallel, ids[:, :1], Cache(2), 0) is None
    assert calls.model == 6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_fused_input_read_from_its_parts_equals_the_concatenated_copy(dtype, monkeypatch):
    """The plan reads a Gated DeltaNet layer's fused input projection (q | k | v | g | b | a) from the six weights in
    place (no concatenated copy: `nparts_W`, the parts' own addresses): the logits of every decoded token are the
    bits of a plan that concatenates them (`PLAN_PARTS` 0 forces the copy). b and a have 2 rows each, so groups of
    four rows straddle the parts."""
    def logits(model):
        model.__dict__.pop("_model_plan", None)
        got = _generate(model, _ids(2))
        return got, model._model_plan.keep[0]

    model = _model(dtype=dtype)
    got, plans = logits(model)
    mixer = model.blocks[0].mixer
    lins = [m for m in (mixer.q_proj, mixer.k_proj, mixer.v_proj, mixer.g_proj, mixer.b_proj, mixer.a_proj)
            if m is not None]
    by_ptr = {m.weight.data_ptr(): m for m in lins}
    assert plans[0].nparts_W == len(lins) == 6 and set(plans[0].parts_W[:6]) == set(by_ptr)
    assert plans[0].W == plans[0].parts_W[0]
    assert list(plans[0].rows_W[:6]) == [by_ptr[a].out_features for a in plans[0].parts_W[:6]]
    assert mixer.b_proj.out_features == mixer.a_proj.out_features == 2
    monkeypatch.setattr(cpu_decode, "PLAN_PARTS", 0)
    ref, plans = logits(model)
    assert plans[0].nparts_W == 0 and plans[0].W not in {m.weight.data_ptr() for m in lins}
    assert torch.equal(got, ref)


def test_the_state_buffer_reused_only_when_nothing_holds_it(monkeypatch):
    """The whole-model step writes its new states into the buffer of the token before last when nothing else holds
    that buffer (two buffers in turn: no fresh memory a token); an entry read from the cache (a view of a buffer), a
    pending step held by a shallow copy of the cache, keep theirs: their values do not change while decoding goes
    on, and the logits are those of a model decoding into fresh buffers (the state read through a shallow copy, whose
    layers are the cache's, is the last step's; the cache's next token then reads the entries)."""
    import copy

    model, ids = _model(), _ids(2, 18)
    calls = CompiledDecodeCalls(monkeypatch)
    ref = _generate(model, ids)
    with torch.no_grad():
        out = model(ids[:, :3], use_cache=True)
        cache, logits, ptrs = out.cache, [out.logits], []
        for t in range(3, 18):
            if t == 6:
                held = cache.layers[0]["mixer"].state   # (a view of the last step's buffer)
                snap = held.clone()
            if t == 9:   # a shallow copy holding the pending step
                twin = copy.copy(cache)
                pending, snap2 = twin.pending, twin.pending.buf.clone()
            if t == 11:   # one whose entries were made (views of the buffer; its pending step dropped)
                viewed = copy.copy(cache).layers[1]["mixer"].state
                snap3 = viewed.clone()
            logits.append(model(ids[:, t:t + 1], cache=cache).logits)
            ptrs.append(cache.pending.buf.data_ptr())
    assert calls.model == 2 * 15
    assert torch.equal(torch.cat(logits, 1), ref)
    assert torch.equal(held, snap) and torch.equal(pending.buf, snap2) and torch.equal(viewed, snap3)
    assert ptrs[-1] == ptrs[-3] and ptrs[-2] == ptrs[-4] and ptrs[-1] != ptrs[-2]   # (reused at the end)


def test_guard_sees_writes_past_its_cheap_signals():
    """The guard looks up its entries only when one of their dicts was written, and the hook dicts only when a hook
    handle was made: a write it does not depend on (a new attribute on a mixer, a hook added to and removed from
    another module) keeps the plan without a rebuild, and a change after those is still seen (a parameter put
    straight into a module's `_parameters`, a hook on a block's FFN)."""
    model = _model()
    ids = _ids(1)
    with torch.no_grad():
        cache = model(ids[:, :3], use_cache=True).cache
        model(ids[:, 3:4], cache=cache)
        guard, built = model._model_plan.guard, decode_plan.rebuilds[0]
        model.blocks[0].mixer.unrelated_note = "seen"
        nn.Linear(2, 2).register_forward_hook(lambda *a: None).remove()
        assert guard.valid()
        model(ids[:, 4:5], cache=cache)
    assert decode_plan.rebuilds[0] == built and model._model_plan.guard is guard
    lin = model.blocks[1].mixer.o_proj
    lin._parameters["weight"] = nn.Parameter(lin.weight.detach() * 0.5)
    assert not guard.valid()
    _generate(model, ids)
    guard = model._model_plan.guard
    assert guard.valid()
    h = model.blocks[0].ffn.register_forward_hook(lambda *a: None)
    assert not guard.valid()
    h.remove()
    assert guard.valid()


def _lines(addrs) -> set:
    return {a & ~63 for a in addrs}


@pytest.mark.parametrize("cause", ["a swapped .data", "an in-place update of a copied weight"])
def test_guard_prefetches_what_it_reads_and_the_list_follows_a_rebuild(cause, monkeypatch):
    """The guard asks for the lines of what `valid` reads (every tensor's object, TensorImpl and storage, the dicts,
    the compared numbers) once at the top of each check; a rebuild makes a new list with the new storages; a write to
    one of its dicts (new version numbers, new objects) makes a new list of them."""
    model = _model()
    ids = _ids(1)
    _generate(model, ids)
    guard = model._model_plan.guard
    if guard.prefetch is None:
        pytest.skip("no compiled prefetch")
    lines = set(guard.prefetch.addresses())
    for t in guard.tensors:
        assert _lines([id(t), t._cdata, t.untyped_storage()._cdata + 16]) <= lines
    assert _lines(map(id, guard.touched)) | _lines(map(id, guard.ptrs)) <= lines
    assert _lines(map(id, guard.dversions)) <= lines
    calls = []
    real = guard.prefetch
    monkeypatch.setattr(guard, "prefetch", lambda: calls.append(1) or real())
    monkeypatch.setattr(guard, "words", None)   # (the Python check: the compiled words' call reads no list)
    assert guard.valid() and calls == [1]
    monkeypatch.undo()
    model.blocks[0].mixer.unrelated_note = "seen"   # (a dict write: the versions read again, new numbers)
    assert guard.valid() and guard.prefetch is not real
    assert _lines(map(id, guard.dversions)) <= set(guard.prefetch.addresses())
    CAUSES[cause](model)
    _generate(model, ids)
    new = model._model_plan.guard
    assert new is not guard and new.valid()
    lines = set(new.prefetch.addresses())
    for t in new.tensors:
        assert _lines([id(t), t._cdata, t.untyped_storage()._cdata + 16]) <= lines
    p = model.blocks[0].norm1.weight
    assert _lines([p.untyped_storage()._cdata + 16]) <= lines


def test_guard_prefetch_list_is_made_on_its_first_call(monkeypatch):
    """The guard's prefetch list is made when the Python check first runs (the words' call needs none), not when
    the guard is built: a plan build pays nothing for it."""
    model = _model()
    _generate(model, _ids(1))
    guard = model._model_plan.guard
    if guard.prefetch is None or guard.words is None:
        pytest.skip("no compiled prefetch or guard words")
    made = []
    real = guard.lines
    monkeypatch.setattr(guard.prefetch, "source", lambda: made.append(1) or real())
    assert guard.prefetch.lines is None and guard.valid() and made == []   # (the words' call: no list)
    monkeypatch.setattr(guard, "words", None)
    assert guard.valid() and guard.valid() and made == [1] and guard.prefetch.n > 0


@pytest.mark.parametrize("cause", list(CAUSES))
def test_guard_without_the_compiled_prefetch_sees_each_cause(cause, monkeypatch):
    """Without prefetch.c (no C compiler for it, or the kernels off for it) the guard has no prefetcher and sees
    every cause as before."""
    monkeypatch.setattr(decode_plan._prefetch, "function", lambda: None)
    model = _model()
    _generate(model, _ids(1))
    guard = model._model_plan.guard
    assert guard.prefetch is None and guard.valid()
    model.blocks[0].mixer.unrelated_note = "seen"
    assert guard.valid() and guard.prefetch is None
    CAUSES[cause](model)
    assert not guard.valid()


def _words_guard(model):
    _generate(model, _ids(1))
    guard = model._model_plan.guard
    if guard.words is None:
        pytest.skip("no compiled guard words here (no guard.c, or this torch / Python layout not recognised)")
    return guard


#: the causes that write a dict the guard holds, or a tensor's storage, data pointer or version
WORD_CAUSES = ["a parameter set where there was None", "a replaced submodule", "a replaced parameter",
               "a swapped .data", "an in-place update of a copied weight", "a configuration value", "a dtype change"]


@pytest.mark.parametrize("cause", list(CAUSES))
def test_the_guard_words_never_pass_what_the_check_refuses(cause):
    """The compiled words' call (cpu/guard.py) only shortcuts the Python check: for every cause, where the check
    refuses the plan the words are not all equal; the causes that change a dict, a storage or a version are seen by
    the words themselves; the check agrees with `valid`."""
    model = _model()
    guard = _words_guard(model)
    words = guard.words
    assert words() and guard.checked() and guard.valid()
    CAUSES[cause](model)
    same = words()
    assert not guard.valid()
    if cause in WORD_CAUSES:
        assert not same
    if not same:
        return
    # (the rest, seen by the flags and cheap checks: the words alone would pass them)
    assert cause not in WORD_CAUSES


def _swap_tensors(model):
    p = model.blocks[0].norm1.weight
    torch.utils.swap_tensors(p, nn.Parameter(p.detach() * 3))


def _storage_moved(model):
    p = model.blocks[0].norm1.weight   # (its storage's memory reallocated: same StorageImpl, a new data pointer)
    p.untyped_storage().resize_(p.untyped_storage().nbytes() * 64)


def _dict_write(model):
    model.blocks[0].mixer.unrelated_note = "seen"


@pytest.mark.parametrize("cause,valid", [(_swap_tensors, False), (_storage_moved, False), (_dict_write, True)])
def test_the_guard_words_and_the_check_agree(cause, valid):
    """A tensor object given another TensorImpl (`torch.utils.swap_tensors`), a storage whose memory moved: the
    words differ and the check refuses; a dict write the plan does not depend on: the words differ, the check
    passes and the words take the dict's new version (equal again, kept)."""
    model = _model()
    guard = _words_guard(model)
    words = guard.words
    cause(model)
    assert not words()
    assert guard.valid() is valid
    if valid:
        assert guard.words is words and words()


def test_the_guard_words_left_where_the_check_passes_a_change_they_see():
    """A change of a recorded word that the Python check does not refuse (a weight's first element as its data: the
    same data pointer, another numel) leaves the Python check alone from then on, not a mismatch every token."""
    model = _model()
    guard = _words_guard(model)
    p = guard.tensors[0]
    assert p.numel() > 1
    p.data = p.data.reshape(-1)[:1]
    assert guard.valid() and guard.words is None and guard.valid()


def test_every_recorded_word_is_compared():
    """Changing any one recorded word (a dict version, any of a tensor's words, a copied tensor's counter or count)
    makes the call say "changed": a call that skipped one compare would pass that change."""
    model = _model()
    words = _words_guard(model).words
    assert words()
    for arr, n in ((words.dvers, words.nd), (words.rec, words.nt * 7), (words.vrec, words.nv * 3)):
        assert n
        for i in range(n):
            if arr is words.vrec and i % 3 == 0:
                continue   # (an index into rec, not a compared word)
            old = arr[i]
            arr[i] = old ^ 1
            assert not words(), (i, old)
            arr[i] = old
    assert words()


def test_the_guard_without_words_when_the_layout_is_unknown(monkeypatch):
    """No layout (another torch or Python, or /proc/self/mem unreadable): no words, the Python check sees every
    cause."""
    monkeypatch.setattr(decode_plan._guard, "layout", lambda fn: None)
    model = _model()
    _generate(model, _ids(1))
    guard = model._model_plan.guard
    assert guard.words is None and guard.valid()
    _swap_data(model)
    assert not guard.valid()
