"""Greedy decoding in one compiled call (models/decode_plan.model_greedy, csrc/decode.c linattn_decode_model_greedy)
against its reference, n calls of the per-token `model_step` each followed by torch's argmax: the tokens, the last
logits and every state, conv window, KV row, length and offset the cache is left with, bit for bit, in fp32, bf16,
int8 and int4 weights at batch 1 and 2, hybrids of the step's kinds (Gated DeltaNet, softmax attention with and
without a sliding window whose cache drops its old rows during the loop, RetNet, Mamba2, KDA, linear attention);
eos stops; ties and NaNs in the logits; a guard invalidated before the call; `generate(temperature=0)`."""
import copy

import pytest
import torch
import torch.nn as nn

from linattn import LinattnError, quantize
from linattn.cpu import decode as cpu_decode
from linattn.layers.cache import KVCache
from linattn.models import LanguageModel, LMConfig, decode_plan
from linattn.models.decode_plan import ModelPending, model_greedy, model_step

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler: the compiled kernels are off")
VOCAB = 64
#: the hybrid: every recurrent kind the whole-model step covers, softmax attention whose cache grows by 3 rows (by
#: half its size every few tokens), and a sliding window of 3 whose cache grows by 2 rows (so it drops its old rows
#: every 2 tokens): `model_greedy` splits its loop at those tokens
HYBRID = ["gated-deltanet", "softmax", "swa", "retnet", "mamba2", "kda", "linear-elu+1"]
#: int4 at this width: the step does not cover Gated DeltaNet's and KDA's mixed-format projections
HYBRID_INT4 = ["softmax", "swa", "retnet", "mamba2", "linear-elu+1"]


def _model(mixers=HYBRID, dtype="fp32", tie=False, seed=0, kv_chunk=3):
    torch.manual_seed(seed)
    model = LanguageModel(LMConfig(vocab_size=VOCAB, d_model=64, n_layers=len(mixers), n_heads=2, mixer=mixers,
                                   ffn_hidden=128, tie_embeddings=tie,
                                   mixer_kwargs={"swa": dict(window=3, kv_chunk=2),
                                                 "softmax": dict(kv_chunk=kv_chunk)})).eval()
    with torch.no_grad():   # (varied picks: larger logits than the initialisation's)
        model.embed.weight.mul_(8.0)
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n or "A_log" in n:
                p.add_(0.1 * torch.randn_like(p))
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    elif dtype in ("int8", "int4", "int8-a8"):   # (-a8: x rounded to int8 per block of 32 in the products)
        mode, _, a8 = dtype.partition("-")
        model = quantize(model, mode, activations="int8" if a8 else "float", inplace=True)
    return model


def _prefill_ids(B, T=5, seed=1):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def _prefill(model, B, T=5, seed=1):
    ids = _prefill_ids(B, T, seed)
    with torch.no_grad():
        out = model(ids, use_cache=True)
    return out.logits[:, -1:].float().argmax(-1), out.cache


def _reference(model, tok, cache, n, eos=None):
    """n per-token `model_step` calls with torch's argmax (a finished row fed eos, as `stream`): (tokens, logits)."""
    toks, done = [], torch.zeros(tok.shape[0], dtype=torch.bool)
    if eos is not None:
        done = tok[:, 0] == eos
    logits = None
    with torch.no_grad():
        for _ in range(n):
            got = model_step(model, tok, cache, 1)
            assert got is not None, "the per-token step does not cover this model"
            logits = got[0]
            tok = logits[:, -1:].argmax(-1)
            if eos is not None:
                tok = torch.where(done[:, None], torch.full_like(tok, eos), tok)
                done = done | (tok[:, 0] == eos)
            toks.append(tok)
            if eos is not None and bool(done.all()):
                break
    return torch.cat(toks, 1), logits


def _greedy(model, tok, cache, n, eos_token_id=None):
    with torch.no_grad():
        return model_greedy(model, tok, cache, n, eos_token_id)


def _bits(t):
    """t's bits as integers (NaNs compare equal, -0.0 and 0.0 do not)."""
    t = t.contiguous()
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()])


def _same(a, b, what):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, what
        assert torch.equal(_bits(a), _bits(b)), what
    elif isinstance(a, KVCache):
        assert (a.length, a.start, a.window, a.chunk) == (b.length, b.start, b.window, b.chunk), what
        assert (a.k is None) == (b.k is None) and (a.k is None or a.k.shape == b.k.shape), what + " capacity"
        if a.k is not None:
            _same(a.k[:, :a.length], b.k[:, :b.length], what + " keys")
            _same(a.v[:, :a.length], b.v[:, :b.length], what + " values")
    elif hasattr(a, "kv") and hasattr(a, "z"):   # (a LinearAttentionState)
        for f in ("kv", "z", "log_scale", "offset"):
            _same(getattr(a, f), getattr(b, f), f"{what}.{f}")
    elif isinstance(a, dict):
        assert set(a) == set(b), what
        for k in a:
            _same(a[k], b[k], f"{what}[{k}]")
    else:
        assert a == b, what


def _same_cache(ref, got):
    """Every entry the two caches hold, bit for bit, and what is still pending in them."""
    assert ref.seen_tokens == got.seen_tokens
    pr, pg = ref.pending, got.pending
    assert type(pr) is type(pg) is ModelPending and pr.n == pg.n and pr.layout.fits(pg.layout)
    _same(pr.offsets, pg.offsets, "pending offsets")
    _same(pr.buf, pg.buf, "pending buffer")
    for i, (a, b) in enumerate(zip(ref.layers, got.layers)):   # (reading the layers applies the pending steps)
        la, lb = a["mixer"], b["mixer"]
        _same(la.offset, lb.offset, f"layer {i} offset")
        _same(la.state, lb.state, f"layer {i} state")
        _same(dict(la.conv), dict(lb.conv), f"layer {i} conv")
        _same(la.kv, lb.kv, f"layer {i} kv")


@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8", "int4", "int8-a8"])
def test_greedy_equals_per_token_steps_bit_for_bit(dtype, B):
    model = _model(HYBRID_INT4 if dtype == "int4" else HYBRID, dtype)
    tok, cache = _prefill(model, B)
    twin = copy.deepcopy(cache)
    n = 9
    want, want_logits = _reference(model, tok, cache, n)
    assert len(set(want.flatten().tolist())) > 2   # (the picks vary: a test of the feedback, not of one id)
    got = _greedy(model, tok, twin, n)
    assert got is not None
    tokens, logits = got
    assert tokens.dtype == torch.int64 and tokens.shape == (B, n)
    assert torch.equal(tokens, want)
    assert logits.dtype == want_logits.dtype and logits.shape == (B, 1, VOCAB)
    _same(want_logits, logits, "logits")
    _same_cache(cache, twin)


def test_greedy_continues_greedy_and_per_token_steps():
    """Two greedy calls, then per-token steps on the same cache, then greedy again from entries another path read
    (the cache's layers applied): the same bits as per-token steps all along."""
    model = _model()
    tok, cache = _prefill(model, 2)
    twin = copy.deepcopy(cache)
    want, got = [], []
    ref_tok = tok
    for k, how in ((4, "greedy"), (3, "greedy"), (None, "read"), (2, "steps"), (3, "greedy")):
        if how == "read":   # (another reader: the entries are made; the next call reuses them)
            _, _ = cache.layers, twin.layers
            continue
        w, _ = _reference(model, ref_tok, cache, k)
        g, _ = (_greedy if how == "greedy" else _reference)(model, tok, twin, k)
        want.append(w)
        got.append(g)
        ref_tok, tok = w[:, -1:], g[:, -1:]
    assert torch.equal(torch.cat(got, 1), torch.cat(want, 1))
    _same_cache(cache, twin)


def test_n_one_is_one_step():
    model = _model()
    tok, cache = _prefill(model, 2)
    twin = copy.deepcopy(cache)
    want, want_logits = _reference(model, tok, cache, 1)
    tokens, logits = _greedy(model, tok, twin, 1)
    assert torch.equal(tokens, want) and torch.equal(logits, want_logits)
    _same_cache(cache, twin)


@pytest.mark.parametrize("B", [1, 2])
def test_eos_stops_once_every_row_has_it(B):
    """eos set to a token the reference picks at step 3 in row 0 (and later in row 1, which keeps decoding: row 0
    then emits eos)."""
    model = _model()
    tok, cache = _prefill(model, B, seed=3)   # (a prompt whose rows pick a common token at different steps)
    free, _ = _reference(model, tok, copy.deepcopy(cache), 12)
    rows = free.tolist()
    # eos: a token row 0 first picks at step >= 2 that row 1 (B = 2) first picks later
    eos = next(e for j, e in enumerate(rows[0]) if j >= 2 and rows[0].index(e) == j
               and (B == 1 or (e in rows[1] and rows[1].index(e) > j)))
    first = [row.index(eos) if eos in row else None for row in rows]
    twin = copy.deepcopy(cache)
    want, want_logits = _reference(model, tok, cache, 12, eos=eos)
    stop = max(12 - 1 if f is None else f for f in first) + 1
    assert want.shape[1] == stop
    tokens, logits = _greedy(model, tok, twin, 12, eos_token_id=eos)
    assert torch.equal(tokens, want) and torch.equal(logits, want_logits)
    _same_cache(cache, twin)
    if B == 2 and first[1] is not None:
        assert (tokens[0, first[0]:] == eos).all()


def test_a_row_whose_input_is_eos_is_finished():
    model = _model()
    tok, cache = _prefill(model, 2)
    free, _ = _reference(model, tok, copy.deepcopy(cache), 6)
    eos = int(tok[0, 0])   # row 0 is finished before the call: its picks are eos
    twin = copy.deepcopy(cache)
    want, _ = _reference(model, tok, cache, 6, eos=eos)
    tokens, _ = _greedy(model, tok, twin, 6, eos_token_id=eos)
    assert torch.equal(tokens, want) and (tokens[0] == eos).all()
    _same_cache(cache, twin)


def test_torch_argmax_picks_the_first_maximum_and_the_first_nan():
    """What the compiled pick copies (checked here, not assumed)."""
    assert int(torch.tensor([1.0, 3.0, 3.0, 2.0]).argmax()) == 1
    assert int(torch.tensor([1.0, float("nan"), 3.0, float("nan")]).argmax()) == 1
    assert int(torch.tensor([float("inf"), 5.0, float("nan")]).argmax()) == 2
    assert int(torch.tensor([-float("inf")] * 3).argmax()) == 0
    assert int(torch.tensor([0.0, -0.0, 0.0]).argmax()) == 0
    assert int(torch.tensor([1.0, 3.0, 3.0], dtype=torch.bfloat16).argmax()) == 1


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_ties_pick_the_first_index(dtype):
    """Every head row doubled (rows 2i and 2i + 1 equal): every logit is tied with its neighbour."""
    model = _model(dtype="fp32", tie=False)
    with torch.no_grad():
        w = model.lm_head.weight
        w[1::2] = w[0::2]
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    tok, cache = _prefill(model, 2)
    twin = copy.deepcopy(cache)
    want, want_logits = _reference(model, tok, cache, 8)
    tokens, logits = _greedy(model, tok, twin, 8)
    assert torch.equal(tokens, want) and (tokens % 2 == 0).all()
    _same(want_logits, logits, "logits")
    _same_cache(cache, twin)


def test_nan_logits_pick_the_first_nan():
    """Head rows a < b NaN: every first pick is a; its embedding row NaN too, so from then on every logit is NaN and
    the pick is 0, the first NaN."""
    model = _model(tie=False)
    tok, cache = _prefill(model, 2)
    seen = set(tok.flatten().tolist()) | set(_prefill_ids(2).flatten().tolist())
    a, b = [i for i in range(VOCAB) if i not in seen][:2]   # (not in the prompt: its prefill refuses NaNs)
    with torch.no_grad():
        model.lm_head.weight[a] = float("nan")
        model.lm_head.weight[b] = float("nan")
        model.embed.weight[a] = float("nan")
    twin = copy.deepcopy(cache)
    want, want_logits = _reference(model, tok, cache, 4)
    tokens, logits = _greedy(model, tok, twin, 4)
    assert torch.equal(tokens, want)
    assert tokens[:, 0].tolist() == [a, a] and (tokens[:, 1:] == 0).all() and torch.isnan(logits).all()
    _same(want_logits, logits, "logits")
    _same_cache(cache, twin)


def test_a_guard_invalidated_before_the_call_rebuilds_the_plan():
    model = _model()
    tok, cache = _prefill(model, 2)
    twin_model, twin = copy.deepcopy(model), copy.deepcopy(cache)
    _greedy(twin_model, tok, copy.deepcopy(cache), 2)   # (a plan built before the change)
    guard = twin_model._model_plan.guard
    for m in (model, twin_model):   # a replaced parameter
        w = m.blocks[0].ffn.w_down
        w.weight = nn.Parameter(w.weight.detach() * 1.5)
    assert not guard.valid()
    built = decode_plan.rebuilds[0]
    want, want_logits = _reference(model, tok, cache, 5)
    tokens, logits = _greedy(twin_model, tok, twin, 5)
    assert decode_plan.rebuilds[0] > built and twin_model._model_plan.guard is not guard
    assert torch.equal(tokens, want) and torch.equal(logits, want_logits)
    _same_cache(cache, twin)


def test_not_covered_returns_none_and_leaves_the_cache():
    model = _model()
    tok, cache = _prefill(model, 2)
    with torch.enable_grad():
        assert model_greedy(model, tok, cache, 3) is None
    model.compiled_decode = False
    seen = cache.seen_tokens
    assert _greedy(model, tok, cache, 3) is None and cache.seen_tokens == seen
    model.compiled_decode = True
    lc = cache.layers[1]["mixer"]   # per-row offsets (rows at different lengths): not covered
    lc.offset = torch.full((2,), lc.offset, dtype=torch.int64)
    assert _greedy(model, tok, cache, 3) is None and cache.seen_tokens == seen


@pytest.mark.parametrize("bad, match", [(dict(n=0), "n must be"), (dict(n=2.0), "n must be"),
                                        (dict(eos_token_id=-1), "eos_token_id"),
                                        (dict(eos_token_id=True), "eos_token_id"), (dict(ids="x"), "ids must be")])
def test_bad_arguments_name_themselves(bad, match):
    model = _model(["softmax"])
    tok, cache = _prefill(model, 1)
    kw = dict(ids=tok, n=2) | bad
    with pytest.raises(LinattnError, match=match):
        model_greedy(model, kw.pop("ids"), cache, **kw)
    with pytest.raises(LinattnError, match="ids must be"):
        model_greedy(model, tok[:, 0], cache, 2)


@pytest.mark.parametrize("eos", [None, "picked"])
@pytest.mark.parametrize("B", [1, 2])
def test_generate_greedy_equals_the_per_token_stream(B, eos, monkeypatch):
    model = _model()
    ids = torch.randint(0, VOCAB, (B, 5), generator=torch.Generator().manual_seed(2))
    prompt = ids[0] if B == 1 else ids
    free = list(model.stream(prompt, 10, temperature=0))
    eos_id = None if eos is None else int((free[4] if B == 1 else free[4][0]))
    calls = []
    inner = decode_plan.model_greedy

    def counted(*a, **k):
        calls.append(1)
        return inner(*a, **k)
    monkeypatch.setattr(decode_plan, "model_greedy", counted)
    want = model.stream(prompt, 10, temperature=0, eos_token_id=eos_id)
    from linattn.models.generation import join_generated
    want = join_generated(model, prompt, list(want))
    assert not calls   # (stream stays per token)
    got = model.generate(prompt, 10, temperature=0, eos_token_id=eos_id)
    assert calls and torch.equal(got, want)


def test_timing_build_counts_each_step_as_a_token(monkeypatch):
    """A plan built under LINATTN_DECODE_TIMING runs the timing build's loop: the same bits, each step one token,
    the picks inside the call's "total" (the sections still add up to it)."""
    monkeypatch.setenv(cpu_decode.TIMING_SWITCH, "1")
    model = _model()
    tok, cache = _prefill(model, 2)
    twin = copy.deepcopy(cache)
    want, want_logits = _reference(model, tok, cache, 6)
    cpu_decode.section_times(reset=True)
    tokens, logits = _greedy(model, tok, twin, 6)
    st = cpu_decode.section_times()
    assert torch.equal(tokens, want) and torch.equal(logits, want_logits)
    _same_cache(cache, twin)
    sec = st["seconds"]
    assert st["tokens"] == 6 and sec["logits"] > 0 and st["python seconds"] >= sec["total"] > 0
    assert sum(v for k, v in sec.items() if k != "total") <= sec["total"] * 1.001 + 1e-6


def test_one_compiled_call_while_the_kv_caches_have_room(monkeypatch):
    """16 tokens on caches with room for them: one call of the greedy loop, no per-token step; a window's cache that
    drops its rows every 2 tokens: a call per stretch between drops."""
    counts = {"greedy": 0}
    inner = cpu_decode.greedy_function

    def greedy_function(dtype):
        fn = inner(dtype)

        def counted(*a):
            counts["greedy"] += 1
            return fn(*a)
        return counted
    monkeypatch.setattr(cpu_decode, "greedy_function", greedy_function)
    for mixers in (["gated-deltanet", "softmax"], ["gated-deltanet", "swa"]):
        counts["greedy"] = 0
        model = _model(mixers, kv_chunk=256)
        tok, cache = _prefill(model, 1)
        twin = copy.deepcopy(cache)
        tokens, _ = _greedy(model, tok, twin, 16)
        assert tokens.shape == (1, 16)
        assert (counts["greedy"] == 1) if mixers[1] == "softmax" else (counts["greedy"] > 4)
        want, _ = _reference(model, tok, cache, 16)
        assert torch.equal(tokens, want)
        _same_cache(cache, twin)


def test_greedy_calls_on_one_cache_rotate_three_buffers(monkeypatch):
    """Calls on one cache allocate no state buffer once three are in rotation (the pending one, the token before
    last's and the slot's spare): a fresh buffer is a new mapping whose pages the loop faults in, and the global
    pool of freed mappings holds only `hugepages.POOL_BYTES`. The tokens and the cache as the per-token steps'."""
    made = []
    inner = decode_plan._hugepages.empty

    def counted(n, dtype):
        made.append(n)
        return inner(n, dtype)
    monkeypatch.setattr(decode_plan._hugepages, "empty", counted)
    model = _model(["gated-deltanet", "softmax"], kv_chunk=256)
    tok, cache = _prefill(model, 2)
    twin = copy.deepcopy(cache)
    per_call, held, toks = [], [], [tok]
    for _ in range(5):   # (the per-token reference after them: its steps on this model's slot take its buffers)
        del made[:]
        got, _ = _greedy(model, toks[-1][:, -1:], twin, 3)
        per_call.append(len(made))
        toks.append(got)
        slot = model._model_plan   # (no name here may hold a buffer: a holder makes the next call allocate)
        held.append({t.data_ptr() if type(t) is torch.Tensor else None
                     for t in (twin.pending.buf, slot.spent, getattr(slot, "spare", None))})
    # the first call: the pair; the second: the third buffer (the first call's input was the prompt's entries)
    assert per_call == [2, 1, 0, 0, 0]
    assert None not in held[1] and len(held[1]) == 3 and held[1] == held[2] == held[3] == held[4]
    want, _ = _reference(model, tok, cache, 15)
    assert torch.equal(torch.cat(toks[1:], 1), want)
    _same_cache(cache, twin)


def test_greedy_leaves_the_buffer_a_copy_of_the_cache_holds():
    """A shallow copy of the cache taken between calls shares the pending buffer: the next calls read it and do not
    take it as their spare, so the copy's states stay as they were."""
    model = _model(["gated-deltanet", "softmax"], kv_chunk=256)
    tok, cache = _prefill(model, 1)
    got, _ = _greedy(model, tok, cache, 4)
    got, _ = _greedy(model, got[:, -1:], cache, 4)
    snap = copy.copy(cache)
    before = snap.pending.buf.clone()
    for _ in range(3):
        got, _ = _greedy(model, got[:, -1:], cache, 4)
    assert snap.pending.buf is not cache.pending.buf and torch.equal(_bits(snap.pending.buf), _bits(before))


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2)])
@pytest.mark.parametrize("dtype", ["fp32", "int8-a8"])
def test_a_thread_count_change_repoints_the_plan_without_a_rebuild(dtype, before, after):
    """torch.set_num_threads between two calls re-points the plan's thread count (the model plan's and every block
    plan's `nthreads`, read per call) instead of rebuilding it (a rebuild copies the fused quantized weights again:
    docs/cpu_kernels.md, Round 18b); the next call's tokens, logits and cache are those of a plan built at the new
    count, bit for bit, fewer threads or more (nothing of the plan is sized by the count). (The autouse fixture puts
    torch's thread count back.)"""
    model = _model(dtype=dtype)
    twin_model = copy.deepcopy(model)
    tok, cache = _prefill(model, 2)
    _, twin = _prefill(twin_model, 2)
    torch.set_num_threads(before)
    first, _ = _greedy(model, tok, cache, 2)
    assert torch.equal(first, _greedy(twin_model, tok, twin, 2)[0])
    slot = model._model_plan
    torch.set_num_threads(after)
    built = decode_plan.rebuilds[0]
    tokens, logits = _greedy(model, first[:, -1:], cache, 5)
    assert decode_plan.rebuilds[0] == built and model._model_plan is slot and slot.guard.valid()
    assert [p.nthreads for p in (slot.plan, *slot.keep[0])] == [after] * (1 + len(HYBRID))
    del twin_model.__dict__["_model_plan"]   # (the reference: a plan built at the new count)
    want, want_logits = _greedy(twin_model, first[:, -1:], twin, 5)
    assert decode_plan.rebuilds[0] > built and twin_model._model_plan.plan.nthreads == after
    assert torch.equal(tokens, want)
    _same(want_logits, logits, "logits")
    _same_cache(twin, cache)
