"""What the tests of the kernelized whole-model plan share (tests/hf/test_kernelize_plan*.py): the (unpatched,
kernelized) pair with weights moved off their init values, prompts, the logits tolerance, the checks that read
the same for every architecture that decodes through transformers' `generate`, and the token-by-token forward of
those that cannot (no attention layer)."""
import copy

import pytest
import torch

from linattn.hf import kernelize
from tests.helpers import CompiledDecodeCalls
from tests.hf.kernelize_models import V, maxdiff

GREEDY = dict(do_sample=False, output_logits=True, return_dict_in_generate=True)


def perturbed_pair(cls, cfg, dtype=torch.float32, hooked=True, moved=(), scaled=()):
    """(unpatched, kernelized) `cls(cfg)` seeded 0: parameters whose name contains one of `moved` get 0.2 x noise
    added (off their init values), those with one of `scaled` are multiplied by 3 (q / k large enough that norms and
    softmax show); `kernelize` must report the compiled decode `hooked`."""
    torch.manual_seed(0)
    ref = cls(cfg)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if any(s in n for s in moved):
                p.add_(0.2 * torch.randn_like(p))
            if any(s in n for s in scaled):
                p.mul_(3.0)
    ref = ref.to(dtype).eval()
    fast = copy.deepcopy(ref)
    assert kernelize(fast).compiled_decode is hooked
    return ref, fast


def prompt(B, T, seed=1):
    return torch.randint(3, V, (B, T), generator=torch.Generator().manual_seed(seed))


def close(a, b, tol=1e-5):
    """Within tol relative to the reference's scale (at least 1)."""
    return maxdiff(a, b) <= tol * max(1.0, b.abs().max().item())


def generate(model, ids, n, **kw):
    """Greedy `generate` of exactly n tokens, the logits returned."""
    return model.generate(ids, max_new_tokens=n, min_new_tokens=n, **{**GREEDY, **kw})


def check_greedy_generate(ref, fast, B, T, n, monkeypatch):
    """Greedy tokens identical, every step's logits within 1e-5, one compiled call per decoded token (the prompt
    is transformers' prefill)."""
    ids = prompt(B, T)
    calls = CompiledDecodeCalls(monkeypatch)
    got = generate(fast, ids, n)
    assert calls.model == n - 1
    want = generate(ref, ids, n)
    assert torch.equal(got.sequences, want.sequences)
    assert close(torch.stack(got.logits), torch.stack(want.logits))


def check_cache_values(ref, fast, monkeypatch, state_dtype=True):
    """After compiled tokens through `generate` the cache holds what transformers' own decode leaves: recurrent and
    conv states, keys and values, the sequence length (`state_dtype` False: the recurrent states' dtypes may differ,
    transformers' own GDN code keeping fp32 states in an fp64 model)."""
    ids = prompt(2, 6)
    calls = CompiledDecodeCalls(monkeypatch)
    got, want = (generate(m, ids, 5).past_key_values for m in (fast, ref))
    assert calls.model == 4
    assert got.get_seq_length() == want.get_seq_length() == 10
    for lg, lw in zip(got.layers, want.layers):
        if hasattr(lg, "recurrent_states"):
            torch.testing.assert_close(lg.recurrent_states[0], lw.recurrent_states[0], rtol=1e-5, atol=1e-6,
                                       check_dtype=state_dtype)
            torch.testing.assert_close(lg.conv_states[0], lw.conv_states[0], rtol=1e-5, atol=1e-6)
        else:
            torch.testing.assert_close(lg.keys, lw.keys, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(lg.values, lw.values, rtol=1e-5, atol=1e-6)


def check_sampling_with_a_seed(ref, fast, monkeypatch):
    ids = prompt(2, 4)
    calls = CompiledDecodeCalls(monkeypatch)
    outs = []
    for m in (fast, ref):
        torch.manual_seed(7)
        outs.append(m.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=True, top_k=20, temperature=0.9))
    assert calls.model == 9
    assert torch.equal(outs[0], outs[1])


def check_beam_search(ref, fast, monkeypatch):
    ids = prompt(1, 5)
    calls = CompiledDecodeCalls(monkeypatch)
    got = fast.generate(ids, max_new_tokens=8, min_new_tokens=8, num_beams=3, do_sample=False)
    assert calls.model > 0
    want = ref.generate(ids, max_new_tokens=8, min_new_tokens=8, num_beams=3, do_sample=False)
    assert torch.equal(got, want)


def check_left_padded_generate(ref, fast, calls, compiled):
    """A left-padded prompt through `generate`: `compiled` compiled calls counted by `calls` (a CompiledDecodeCalls
    made before the plan: 0 where the plan steps aside, every decoded token where the mask only enters the prefill),
    the unpatched model's tokens and logits. The prompt and mask returned."""
    ids = prompt(2, 7)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    got = generate(fast, ids, 6, attention_mask=mask)
    assert calls.model == compiled
    want = generate(ref, ids, 6, attention_mask=mask)
    assert torch.equal(got.sequences, want.sequences)
    assert close(torch.stack(got.logits), torch.stack(want.logits))
    return ids, mask


def at(positions: bool, pos: int) -> dict:
    """The keywords of a one-token call at position pos: its position ids when `positions` (models whose forward
    does not take them from the cache, Bamba's), else none."""
    return {"position_ids": torch.full((1, 1), pos)} if positions else {}


def check_cache_copied_and_advanced(ref, fast, watched, monkeypatch, positions=False):
    """A deep copy of the cache decoded on its own (the original's `watched(cache)` tensor unchanged); tokens
    decoded by transformers' own code (LINATTN_CPU_KERNELS=0) between compiled ones; a generate continued on a
    returned cache: the unpatched model's logits throughout (`positions`: each token's position ids passed, for
    models whose forward does not take them from the cache)."""
    ids = prompt(2, 6)
    calls = CompiledDecodeCalls(monkeypatch)
    with torch.no_grad():
        outs = [m(ids, use_cache=True) for m in (fast, ref)]
        caches = [o.cache for o in outs]
        tok = outs[1].logits[:, -1:].argmax(-1)
        for step in range(8):
            if step == 3:
                copies = [copy.deepcopy(c) for c in caches]
                snap = watched(caches[0]).clone()
                lc = [m(tok, cache=c, **at(positions, 6 + step)).logits for m, c in zip((fast, ref), copies)]
                assert close(lc[0], lc[1])
                assert torch.equal(watched(caches[0]), snap)
            if step in (4, 5):
                monkeypatch.setenv("LINATTN_CPU_KERNELS", "0")
            else:
                monkeypatch.delenv("LINATTN_CPU_KERNELS", raising=False)
            lg = [m(tok, cache=c, **at(positions, 6 + step)).logits for m, c in zip((fast, ref), caches)]
            assert close(lg[0], lg[1]), step
            tok = lg[1].argmax(-1)
    assert calls.model == 8 - 2 + 1
    got, want = generate(fast, ids, 4), generate(ref, ids, 4)
    more = [generate(m, g.sequences, 5, cache=g.past_key_values) for m, g in zip((fast, ref), (got, want))]
    assert torch.equal(more[0].sequences, more[1].sequences)
    assert close(torch.stack(more[0].logits), torch.stack(more[1].logits))


def one_token_each(ref, fast, positions=False):
    """(the prompt's last token, [fast's cache, ref's cache]) after a 2 x 5 prompt and that token decoded once by
    each model, without grad (`positions`: `at`'s): the pair ready for a token after a change between tokens."""
    ids = prompt(2, 5)
    tok = ids[:, -1:]
    with torch.no_grad():
        caches = [m(ids, use_cache=True).cache for m in (fast, ref)]
        for m, c in zip((fast, ref), caches):
            m(tok, cache=c, **at(positions, 5))
    return tok, caches


def next_logits(ref, fast, tok, caches, positions=False):
    """[fast's, ref's] logits of `tok` decoded at position 6 on `one_token_each`'s caches, without grad."""
    with torch.no_grad():
        return [m(tok, cache=c, **at(positions, 6)).logits for m, c in zip((fast, ref), caches)]


def check_changed_between_tokens(ref, fast, change, rebuilt, monkeypatch, positions=False):
    """`change(model)` applied to both models between two compiled tokens: the plan's guard fails exactly when
    `rebuilt` (the plan copied what changed, or reads it when it is built), and the next token is the unpatched
    model's with the change (`positions`: `at`'s)."""
    calls = CompiledDecodeCalls(monkeypatch)
    tok, caches = one_token_each(ref, fast, positions)
    guard = fast._linattn_model_plan.guard
    with torch.no_grad():
        for m in (fast, ref):
            change(m)
    assert guard.valid() is not rebuilt
    lg = next_logits(ref, fast, tok, caches, positions)
    assert calls.model == 2
    assert close(lg[0], lg[1])


def check_in_place_update(ref, fast, name, copied, monkeypatch, positions=False):
    """Parameter `name` updated in place between tokens: the plan's guard fails exactly when the plan `copied` it,
    and the next token reads the new value (`positions`: `at`'s)."""
    check_changed_between_tokens(ref, fast, lambda m: m.get_parameter(name).add_(0.5), copied, monkeypatch,
                                 positions)


def check_broken_plan(ref, fast, breaks):
    """A planted error: `breaks(block_plans, model_plan)` changes the kernelized model's plan after a token; the
    next token's logits must then leave the unpatched model's (what the comparisons check is what that part of the
    plan computes)."""
    tok, caches = one_token_each(ref, fast)
    slot = fast._linattn_model_plan
    breaks(slot.keep[0], slot.plan)
    got, want = next_logits(ref, fast, tok, caches)
    assert not close(got, want, 1e-3)


def check_output_class(ref, fast, monkeypatch, positions=False):
    """A compiled token returns the class the unpatched forward returns; (its output, the unpatched one's)."""
    ids = prompt(2, 5)
    calls = CompiledDecodeCalls(monkeypatch)
    with torch.no_grad():
        caches = [m(ids, use_cache=True).cache for m in (fast, ref)]
        got, want = (m(ids[:, -1:], cache=c, **at(positions, 5)) for m, c in zip((fast, ref), caches))
    assert calls.model == 1 and type(got) is type(want)
    assert close(got.logits, want.logits)
    return got, want


def check_hook_steps_aside(ref, fast, module, monkeypatch):
    """A forward hook on `module` (a described module of `fast`): every token runs transformers' forward."""
    seen = []
    module.register_forward_hook(lambda *a: seen.append(1))
    calls = CompiledDecodeCalls(monkeypatch)
    ids = prompt(1, 4)
    got, want = generate(fast, ids, 4), generate(ref, ids, 4)
    assert calls.model == 0 and len(seen) == 4
    assert torch.equal(got.sequences, want.sequences)


def check_bf16(ref, fast, dtype, monkeypatch, positions=False):
    """bf16 weights, computed in fp32: the logits (of `dtype`) within bf16's rounding of the unpatched model's
    (`positions`: `at`'s)."""
    ids = prompt(2, 5)
    tok = ids[:, -1:]
    calls = CompiledDecodeCalls(monkeypatch)
    with torch.no_grad():
        caches = [m(ids, use_cache=True).cache for m in (fast, ref)]
        for i in range(4):
            lg = [m(tok, cache=c, **at(positions, 5 + i)).logits for m, c in zip((fast, ref), caches)]
            assert lg[0].dtype == lg[1].dtype == dtype
            assert close(lg[0].float(), lg[1].float(), 0.05)
            tok = lg[1].argmax(-1)
    assert calls.model == 4


def check_torch_compile_steps_aside(fast, monkeypatch, positions=False):
    """A cached one-token call inside torch.compile runs transformers' code (traced), not the compiled plan: the
    same logits as the eager call on a copy of the cache, no compiled call (`positions`: `at`'s). The backend is
    aot_eager: dynamo's tracing (where the hook steps aside) and AOTAutograd's are inductor's, without inductor's
    code generation and C++ builds (47-55 CPU-s a model with a cold cache, against 8-23)."""
    ids = prompt(1, 5)
    calls = CompiledDecodeCalls(monkeypatch)
    with torch.no_grad():
        cache = fast(ids, use_cache=True).cache
        twin = copy.deepcopy(cache)
        tok = ids[:, -1:]
        torch._dynamo.reset()
        got = torch.compile(fast, backend="aot_eager")(tok, cache=cache, **at(positions, 5)).logits
        assert calls.model == 0
        want = fast(tok, cache=twin, **at(positions, 5)).logits
    assert calls.model == 1
    assert close(got, want)
    torch._dynamo.reset()


class GenerateChecks:
    """The checks every description whose models run transformers' `generate` shares, as tests. A test file's
    `class TestGenerate(pd.GenerateChecks)` runs them on its models: it gives `make_pair` (a function,
    `make_pair(dtype=torch.float32)` -> (unpatched, kernelized): `perturbed_pair`'s; or, for several architectures,
    a parametrised fixture `pair` in its place), `described_module(fast)` (a module of the plan's whose hook makes
    it step aside) and, where they differ from these defaults:"""

    #: whether each one-token call passes its position ids (`at`'s: Bamba's forward needs them)
    POSITIONS = False
    #: the dtype of a bf16 model's logits (transformers' Mamba2 and Nemotron-H return fp32 ones)
    BF16_LOGITS = torch.bfloat16
    #: compiled calls for a left-padded prompt: 0, the plan steps aside (the mask enters every token's attention)
    LEFT_PADDED_COMPILED = 0
    #: `make_pair`'s arguments for the torch.compile check: the smallest model with each mixer kind once and, unless
    #: the architecture is an MoE one, no experts (where the hook steps aside is the model's forward, before any
    #: layer; dynamo traces every layer, and transformers' expert loops break its graph into many)
    COMPILE_PAIR: dict = {}

    def described_module(self, fast):
        raise NotImplementedError("a GenerateChecks subclass names a described module")

    @pytest.fixture
    def pair(self):
        return self.make_pair

    def test_sampling_with_a_seed(self, pair, monkeypatch):
        check_sampling_with_a_seed(*pair(), monkeypatch)

    def test_beam_search_reorders_the_cache(self, pair, monkeypatch):
        check_beam_search(*pair(), monkeypatch)

    def test_left_padded_generate(self, pair, monkeypatch):
        """The unpatched model's tokens and logits; no compiled call where the plan steps aside."""
        check_left_padded_generate(*pair(), CompiledDecodeCalls(monkeypatch), self.LEFT_PADDED_COMPILED)

    def test_a_hook_on_a_described_module_steps_aside(self, pair, monkeypatch):
        ref, fast = pair()
        check_hook_steps_aside(ref, fast, self.described_module(fast), monkeypatch)

    def test_bf16_decodes_through_the_plan(self, pair, monkeypatch):
        """bf16 weights: read as stored and computed in fp32; the logits within bf16's rounding of the unpatched
        model's (which rounds every activation to bf16)."""
        check_bf16(*pair(torch.bfloat16), self.BF16_LOGITS, monkeypatch, self.POSITIONS)

    def test_under_torch_compile_the_plan_steps_aside(self, pair, monkeypatch):
        check_torch_compile_steps_aside(pair(**self.COMPILE_PAIR)[1], monkeypatch, self.POSITIONS)

    def test_the_hook_returns_the_unpatched_forwards_output_class(self, pair, monkeypatch):
        check_output_class(*pair(), monkeypatch, self.POSITIONS)


# -- models without an attention layer (Kimi Linear, Bailing hybrid made of KDA layers): transformers' cache reports
#    no sequence length, so `generate` cannot run them; they decode token by token through the forward with explicit
#    position ids and the per-layer-type masks as a dict, which transformers' forward takes as they are

#: the per-layer-type masks of an unpadded batch
NO_MASK = {"full_attention": None, "linear_attention": None}


def prefill(models, prompt):
    """([last logits], [caches]) of each model after the prompt."""
    pos = torch.arange(prompt.shape[1]).unsqueeze(0)
    outs = [m(prompt, position_ids=pos, use_cache=True, attention_mask=NO_MASK) for m in models]
    return [o.logits[:, -1:] for o in outs], [o.past_key_values for o in outs]


def step(model, tok, cache, pos, **kw):
    """The logits of one cached token at position pos."""
    kw.setdefault("attention_mask", NO_MASK)
    return model(tok, cache=cache, position_ids=torch.full((1, 1), pos), **kw).logits


def prefilled(models, prompt):
    """(the last model's greedy next token, the caches) after the prompt."""
    logits, caches = prefill(models, prompt)
    return logits[-1].argmax(-1), caches


def decode(models, tok, caches, pos, n, check=None):
    """n tokens decoded greedily (the last model's picks) from position pos, `check(logits)` at each; the last
    token."""
    for i in range(n):
        lg = [step(m, tok, c, pos + i) for m, c in zip(models, caches)]
        if check is not None:
            check(lg)
        tok = lg[-1].argmax(-1)
    return tok


def check_forward_greedy(ref, fast, B, T, n, monkeypatch):
    """Token by token through the forward: greedy tokens identical, every step's logits within 1e-5 (relative to
    their scale), one compiled call per decoded token (the prompt is transformers' prefill)."""
    ids = prompt(B, T)
    calls = CompiledDecodeCalls(monkeypatch)
    with torch.no_grad():
        (lg, lw), caches = prefill((fast, ref), ids)
        toks = [lg.argmax(-1), lw.argmax(-1)]
        for i in range(n):
            assert torch.equal(toks[0], toks[1]), i
            lg, lw = (step(m, t, c, T + i) for m, t, c in zip((fast, ref), toks, caches))
            assert close(lg, lw), i
            toks = [lg.argmax(-1), lw.argmax(-1)]
    assert calls.model == n


def check_forward_cache_values(ref, fast, n_layers, monkeypatch):
    """After compiled tokens through the forward the cache holds what transformers' own decode leaves: recurrent and
    conv states of every layer."""
    calls = CompiledDecodeCalls(monkeypatch)
    with torch.no_grad():
        tok, caches = prefilled((fast, ref), prompt(2, 6))
        decode((fast, ref), tok, caches, 6, 5)
    assert calls.model == 5
    got, want = caches
    assert len(got.layers) == len(want.layers) == n_layers
    for lg, lw in zip(got.layers, want.layers):
        assert lg.recurrent_states[0].dtype == lw.recurrent_states[0].dtype
        torch.testing.assert_close(lg.recurrent_states[0], lw.recurrent_states[0], rtol=1e-5, atol=1e-6)
        assert lg.conv_states[0].shape == lw.conv_states[0].shape
        torch.testing.assert_close(lg.conv_states[0], lw.conv_states[0], rtol=1e-5, atol=1e-6)


def check_forward_cache_copied_and_advanced(ref, fast, monkeypatch):
    """Through the forward: a deep copy of the cache decoded on its own (the original unchanged); tokens decoded by
    transformers' own code (LINATTN_CPU_KERNELS=0) between compiled ones, and compiled ones after them: the unpatched
    model's logits throughout."""
    calls = CompiledDecodeCalls(monkeypatch)
    with torch.no_grad():
        tok, caches = prefilled((fast, ref), prompt(2, 6))
        for i in range(8):
            pos = 6 + i
            if i == 3:
                copies = [copy.deepcopy(c) for c in caches]
                snap = caches[0].layers[1].recurrent_states[0].clone()
                lc = [step(m, tok, c, pos) for m, c in zip((fast, ref), copies)]
                assert close(lc[0], lc[1])
                assert torch.equal(caches[0].layers[1].recurrent_states[0], snap)
            if i in (4, 5):
                monkeypatch.setenv("LINATTN_CPU_KERNELS", "0")
            else:
                monkeypatch.delenv("LINATTN_CPU_KERNELS", raising=False)
            lg = [step(m, tok, c, pos) for m, c in zip((fast, ref), caches)]
            assert close(lg[0], lg[1]), i
            tok = lg[1].argmax(-1)
    assert calls.model == 8 - 2 + 1


def check_forward_in_place_update(ref, fast, name, copied, monkeypatch):
    """Through the forward, parameter `name` updated in place between tokens: the plan's guard fails exactly when
    the plan `copied` it, and the next token reads the new value."""
    calls = CompiledDecodeCalls(monkeypatch)
    with torch.no_grad():
        tok, caches = prefilled((fast, ref), prompt(2, 5))
        for m, c in zip((fast, ref), caches):
            step(m, tok, c, 5)
        guard = fast._linattn_model_plan.guard
        for m in (fast, ref):
            m.get_parameter(name).add_(0.5)
        assert guard.valid() is not copied
        lg = [step(m, tok, c, 6) for m, c in zip((fast, ref), caches)]
    assert calls.model == 2
    assert close(lg[0], lg[1])


def check_forward_bf16(ref, fast, monkeypatch):
    """Through the forward, bf16 weights computed in fp32: bf16 logits within bf16's rounding of the unpatched
    model's (which rounds every activation to bf16)."""
    calls = CompiledDecodeCalls(monkeypatch)

    def check(lg):
        assert lg[0].dtype == torch.bfloat16
        assert close(lg[0].float(), lg[1].float(), 0.05)

    with torch.no_grad():
        decode((fast, ref), *prefilled((fast, ref), prompt(2, 5)), 5, 4, check)
    assert calls.model == 4


def check_not_described(ref, fast, reason, why, describe, generates, monkeypatch):
    """A model the plan does not describe (`reason(fast)` contains `why`, `describe(fast)` None) is not hooked: its
    forward stays the class's, and where `generate` runs (`generates`: a model with an attention layer, whose cache
    reports a length) it gives the unpatched model's tokens and logits with no compiled call."""
    assert why in reason(fast)
    assert "forward" not in fast.__dict__ and describe(fast) is None
    if not generates:
        return
    ids = prompt(2, 5)
    calls = CompiledDecodeCalls(monkeypatch)
    got, want = (generate(m, ids, 6) for m in (fast, ref))
    assert calls.model == 0
    assert torch.equal(got.sequences, want.sequences)
    assert close(torch.stack(got.logits), torch.stack(want.logits))


def conv_io_decoded(model, B: int, n: int, io) -> list:
    """(logits, recurrent states, conv states) after each of n compiled tokens after a 5-token prompt; io(step):
    whether the step may take the in-place path (False: `_conv_io` refuses, the buffers' path runs)."""
    import linattn.hf.kernelize_plan as kp
    conv_io, out = kp._conv_io, []
    ids = prompt(B, 5)
    with torch.no_grad():
        cache = model(ids, use_cache=True).cache
        tok = ids[:, -1:]
        for step in range(n):
            kp._conv_io = conv_io if io(step) else (lambda *a: None)
            try:
                lg = model(tok, cache=cache).logits
            finally:
                kp._conv_io = conv_io
            assert (model._linattn_model_plan.plan.w_io_at is not None) == io(step)
            lay = [c for c in cache.layers if hasattr(c, "conv_states")]
            out.append((lg.clone(), [c.recurrent_states[0].clone() for c in lay],
                        [c.conv_states[0].clone() for c in lay]))
            tok = lg.argmax(-1)
    return out


def check_conv_states_in_place(ref, model, B, monkeypatch):
    """The compiled call reads and advances transformers' conv states in place (`kernelize_plan._conv_io`): bit for
    bit the buffers' path, token by token, for 5 tokens after a 5-token prompt; and the unpatched model's logits."""
    calls = CompiledDecodeCalls(monkeypatch)
    got, want = conv_io_decoded(model, B, 5, lambda step: True), conv_io_decoded(model, B, 5, lambda step: False)
    assert calls.model == 10
    for step, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g[0], w[0]) and all(map(torch.equal, g[1] + g[2], w[1] + w[2])), step
    ids = prompt(B, 5)
    with torch.no_grad():
        cache = ref(ids, use_cache=True).cache
        tok = ids[:, -1:]
        for step in range(5):
            lg = ref(tok, cache=cache).logits
            assert close(got[step][0].float(), lg.float()), step
            tok = lg.argmax(-1)
