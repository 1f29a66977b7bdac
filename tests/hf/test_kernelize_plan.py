"""A kernelized Qwen3.5 or Qwen3-Next (dense feed-forwards) decodes through the compiled whole-model plan
(hf/kernelize_plan.py): through transformers' `generate`, against the UNPATCHED model (transformers' PyTorch
code): greedy tokens identical and logits within 1e-5 (fp32), sampled tokens with a seed, batch > 1, beam search
(the cache reordered between tokens), a cache reused, copied or advanced by transformers' own code between
compiled tokens, left padding (the plan steps aside), one compiled call per decoded token, and the plan rebuilt
when a weight it copied is updated in place."""
import copy
import inspect
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from linattn.cpu import decode as cpu_decode  # noqa: E402
from tests.helpers import CompiledDecodeCalls  # noqa: E402
from tests.hf import plan_decode as pd  # noqa: E402
from tests.hf.kernelize_models import (  # noqa: E402
    ATTN,
    GDN,
    transformers_torch_code,  # noqa: F401  (autouse)
)

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler: the compiled kernels are off")


ARCHS = ("qwen3_5", "qwen3_next")
#: a GDN layer's projections that the plan copies into its fused matrix, per architecture
FUSED = {"qwen3_5": "in_proj_z", "qwen3_next": "in_proj_qkvz"}


def _config(arch, layers, tied):
    if arch == "qwen3_next":   # dense feed-forwards (no experts), a partial rotary as Qwen3-Next's
        if not hasattr(transformers, "Qwen3NextForCausalLM"):
            pytest.skip(f"the installed transformers ({transformers.__version__}) has no Qwen3-Next")
        cfg = transformers.Qwen3NextConfig(**ATTN, **GDN, num_hidden_layers=len(layers), layer_types=list(layers),
                                           tie_word_embeddings=tied, num_experts=0, partial_rotary_factor=0.5)
        return cfg, transformers.Qwen3NextForCausalLM
    cfg = transformers.Qwen3_5TextConfig(**ATTN, **GDN, num_hidden_layers=len(layers), layer_types=list(layers),
                                         tie_word_embeddings=tied)
    return cfg, transformers.Qwen3_5ForCausalLM


def _pair(dtype=torch.float32, tied=False, layers=("linear_attention", "full_attention", "linear_attention",
                                                   "full_attention"), arch="qwen3_5"):
    """(unpatched, kernelized) model of 4 layers, 2 of them softmax attention; the norms, A_log / dt_bias and the
    gated norm moved off their init values, q / k scaled up so that the attention's softmax and RoPE show."""
    cfg, cls = _config(arch, layers, tied)
    return pd.perturbed_pair(cls, cfg, dtype, moved=("norm", "A_log", "dt_bias"),
                             scaled=("q_proj", "k_proj", "in_proj_qkvz"))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("B,T,n,tied", [(1, 1, 12, False), (3, 9, 70, False), (2, 5, 8, True)])
def test_greedy_generate_matches_the_unpatched_model(B, T, n, tied, arch, monkeypatch):
    """70 tokens grow the KV buffers past their chunk."""
    ref, fast = _pair(tied=tied, arch=arch)
    assert inspect.signature(fast.forward) == inspect.signature(ref.forward)
    pd.check_greedy_generate(ref, fast, B, T, n, monkeypatch)


@pytest.mark.parametrize("arch", ARCHS)
def test_cache_objects_hold_transformers_values(arch, monkeypatch):
    """After compiled tokens the cache holds what transformers' own decode leaves: recurrent and conv states, keys
    and values, the sequence length."""
    pd.check_cache_values(*_pair(arch=arch), monkeypatch)


@pytest.mark.parametrize("arch", ARCHS)
def test_sampling_with_a_seed(arch, monkeypatch):
    pd.check_sampling_with_a_seed(*_pair(arch=arch), monkeypatch)


@pytest.mark.parametrize("arch", ARCHS)
def test_beam_search_reorders_the_cache(arch, monkeypatch):
    """Beam search reorders transformers' cache between tokens (new tensors): the plan rebuilds its KV buffers
    from them and gives the unpatched model's beams."""
    pd.check_beam_search(*_pair(arch=arch), monkeypatch)


@pytest.mark.parametrize("arch", ARCHS)
def test_left_padding_steps_aside(arch, monkeypatch):
    """A padded attention mask: the plan cannot honour it (its GDN layers take every token), so every token runs
    transformers' forward; the tokens and logits are the unpatched model's."""
    pd.check_left_padded_generate(*_pair(arch=arch), CompiledDecodeCalls(monkeypatch), 0)


def test_cache_reused_copied_and_advanced_by_transformers_between_calls(monkeypatch):
    pd.check_cache_copied_and_advanced(*_pair(), lambda c: c.layers[1].keys, monkeypatch)


def test_conv_states_copied_and_advanced_by_transformers_between_calls(monkeypatch):
    """The GDN layers' conv states are views of one tensor after a compiled token (kernelize_plan._conv_stack): a
    deep copy decoded on its own leaves the original's unchanged, transformers' own steps (which write them in
    place) between compiled ones are read by the next compiled token."""
    pd.check_cache_copied_and_advanced(*_pair(), lambda c: c.layers[0].conv_states[0], monkeypatch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_state_written_in_place_between_tokens(dtype, monkeypatch):
    """A conv state written in place between compiled tokens (a version the plan did not leave): the next token
    reads the new values, as the unpatched model does; so does one replaced by another tensor (bf16: transformers'
    conv states in bf16, the plan's windows in fp32). Three GDN layers: the middle one is replaced."""
    ref, fast = _pair(dtype=dtype, layers=("linear_attention",) * 3 + ("full_attention",))
    tol = 1e-5 if dtype == torch.float32 else 0.05
    ids = pd.prompt(2, 5)
    calls = CompiledDecodeCalls(monkeypatch)
    with torch.no_grad():
        caches = [m(ids, use_cache=True).cache for m in (fast, ref)]
        tok = ids[:, -1:]
        for step in range(4):
            lg = [m(tok, cache=c).logits for m, c in zip((fast, ref), caches)]
            assert pd.close(lg[0].float(), lg[1].float(), tol), step
            tok = lg[1].argmax(-1)
            for c in caches:
                if step == 1:
                    c.layers[0].conv_states[0][..., -1].mul_(-2.0)
                if step == 2:
                    c.layers[1].conv_states[0] = c.layers[1].conv_states[0] * 0.5
        lg = [m(tok, cache=c).logits for m, c in zip((fast, ref), caches)]
        assert pd.close(lg[0].float(), lg[1].float(), tol)
    assert calls.model == 5
    for lg_, lw in zip(caches[0].layers, caches[1].layers):
        if hasattr(lg_, "conv_states"):
            torch.testing.assert_close(lg_.conv_states[0].float(), lw.conv_states[0].float(), rtol=tol, atol=tol)


#: what the plan copies: (1 + w), -exp(A_log), Qwen3-Next's GDN projections (regrouped per key head); it reads
#: gate | up and Qwen3.5's GDN projections from their parts in place
COPIED = {"model.layers.0.input_layernorm.weight", "model.layers.2.linear_attn.A_log", "model.norm.weight",
          "model.layers.1.self_attn.q_norm.weight"}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", sorted(COPIED) + ["model.layers.1.mlp.up_proj.weight",
                                                   "model.layers.0.linear_attn.FUSED.weight"])
def test_in_place_update_of_a_weight(name, arch, monkeypatch):
    """A weight the plan copied, updated in place between tokens, invalidates the plan; one it reads in place (a
    part of a fused product) does not; either way the next token reads the new value."""
    copied = name in COPIED or (arch == "qwen3_next" and "FUSED" in name)
    pd.check_in_place_update(*_pair(arch=arch), name.replace("FUSED", FUSED[arch]), copied, monkeypatch)


def test_a_hook_on_a_described_module_steps_aside(monkeypatch):
    ref, fast = _pair()
    pd.check_hook_steps_aside(ref, fast, fast.model.layers[1].mlp.down_proj, monkeypatch)


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_decodes_through_the_plan(arch, monkeypatch):
    """bf16 weights: the plan reads them as stored and computes in fp32; the logits stay within bf16's rounding
    of the unpatched model's (which rounds every activation to bf16)."""
    pd.check_bf16(*_pair(torch.bfloat16, arch=arch), torch.bfloat16, monkeypatch)


def test_under_torch_compile_the_plan_steps_aside(monkeypatch):
    # (two layers, one of each kind: dynamo traces every layer, and where the hook steps aside is the model's)
    pd.check_torch_compile_steps_aside(_pair(layers=("linear_attention", "full_attention"))[1], monkeypatch)


def test_position_ids_other_than_the_cache_length_step_aside(monkeypatch):
    """A token at a position the cache does not end at (position ids given explicitly) runs transformers' forward,
    with the unpatched model's logits; at the cache length it takes the plan."""
    ref, fast = _pair()
    prompt = pd.prompt(2, 5)
    calls = CompiledDecodeCalls(monkeypatch)
    with torch.no_grad():
        caches = [m(prompt, use_cache=True).past_key_values for m in (fast, ref)]
        tok = prompt[:, -1:]
        for pos, n in ((9, 0), (4, 0), (7, 1)):   # (the cache holds 5, 6, then 7 tokens)
            ids = torch.full((2, 1), pos)
            lg = [m(tok, cache=c, position_ids=ids).logits for m, c in zip((fast, ref), caches)]
            assert calls.model == n
            assert pd.close(lg[0], lg[1])


def test_qwen3_next_fused_rows_regrouped_as_its_own_split():
    """The plan's `[q | k | v | b | a | z]` rows of Qwen3-Next's fused in_proj_qkvz / in_proj_ba: the same values
    as transformers' own `fix_query_key_value_ordering` (fp64, 2 value heads per key head)."""
    from linattn.hf.kernelize_plan import _GDN
    ref, _ = _pair(arch="qwen3_next")
    layer = ref.model.layers[0].linear_attn.double()
    x = torch.randn(3, 1, ATTN["hidden_size"], dtype=torch.float64)
    with torch.no_grad():
        q, k, v, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(x), layer.in_proj_ba(x))
        W = _GDN(layer, "Qwen3NextForCausalLM").W.parts   # (one part: the regrouped copy)
        assert len(W) == 1
        y = x @ W[0].T
    want = torch.cat([t.reshape(3, 1, -1) for t in (q, k, v, b, a, z)], -1)
    assert y.shape == want.shape
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_products_read_from_their_parts_equal_the_concatenated_copy(dtype, monkeypatch):
    """Qwen3.5's GDN projections (in_proj_qkv | b | a | z) and every MLP's gate | up are read from transformers'
    weights in place (the plan points at them: no copy of the fused matrices); every decoded token's logits are the
    bits of a plan that concatenates them (`PLAN_PARTS` 0 forces the copies)."""
    _, fast = _pair(dtype)
    ids = pd.prompt(2, 5)

    def run():
        fast.__dict__.pop("_linattn_model_plan", None)
        out = pd.generate(fast, ids, 4)
        return torch.stack(out.logits), fast._linattn_model_plan.keep[0]

    got, plans = run()
    layer = fast.model.layers[0]
    gdn = [layer.linear_attn._modules[n].weight for n in ("in_proj_qkv", "in_proj_b", "in_proj_a", "in_proj_z")]
    assert list(plans[0].parts_W[:plans[0].nparts_W]) == [w.data_ptr() for w in gdn]
    assert list(plans[0].parts_Wgu[:plans[0].nparts_Wgu]) == [layer.mlp.gate_proj.weight.data_ptr(),
                                                              layer.mlp.up_proj.weight.data_ptr()]
    monkeypatch.setattr(cpu_decode, "PLAN_PARTS", 0)
    ref, plans = run()
    assert plans[0].nparts_W == plans[0].nparts_Wgu == 0
    assert torch.equal(got, ref)


def test_the_state_buffer_reused_only_when_nothing_holds_it(monkeypatch):
    """The plan writes a token's new recurrent states into the buffer of the token before last when nothing holds it
    any more (two buffers in turn: no fresh memory and no page faults a token); a state read from the cache and kept
    (a view of its buffer) keeps its buffer: its values do not change while decoding goes on, and the logits stay
    the unpatched model's."""
    ref, fast = _pair()
    ids = pd.prompt(2, 16)
    calls = CompiledDecodeCalls(monkeypatch)
    got, want, ptrs = [], [], []
    with torch.no_grad():
        outs = [m(ids[:, :3], use_cache=True) for m in (fast, ref)]
        caches = [getattr(o, "cache", None) or o.past_key_values for o in outs]
        for t in range(3, 16):
            if t == 6:
                held = caches[0].layers[0].recurrent_states[0]   # (a view of the last token's buffer)
                snap = held.clone()
            for m, c, out in zip((fast, ref), caches, (got, want)):
                out.append(m(ids[:, t:t + 1], cache=c, use_cache=True).logits)
            ptrs.append(caches[0].layers[0].recurrent_states[0].data_ptr())
    assert calls.model == 13
    assert pd.close(torch.cat(got, 1), torch.cat(want, 1))
    assert torch.equal(held, snap) and held.data_ptr() not in ptrs[4:]
    assert ptrs[-1] == ptrs[-3] and ptrs[-2] == ptrs[-4] and ptrs[-1] != ptrs[-2]   # (reused)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_states_shift_by_one_column_bit_for_bit(dtype, monkeypatch):
    """After every compiled token each GDN layer's conv state `[B, C, K]` is the one before it shifted left by a
    column, bit for bit, with the plan's new window's last column (the token's input, in the state's dtype) last:
    what transformers' conv update leaves (`kernelize_plan._shift_in`: one memmove of the stacked states, one column
    copy). Three GDN layers, 7 tokens: the first reads a fresh stack of the prefill's states, later ones the last
    token's buffer, and after an in-place write between tokens a fresh stack again."""
    ref, fast = _pair(dtype=dtype, layers=("linear_attention",) * 3 + ("full_attention",))
    ids = pd.prompt(2, 5)
    calls = CompiledDecodeCalls(monkeypatch)
    gdn = [0, 1, 2]
    with torch.no_grad():
        cache = fast(ids, use_cache=True).cache
        tok = ids[:, -1:]
        for step in range(7):
            if step == 4:
                cache.layers[1].conv_states[0][..., -1].mul_(-2.0)   # (transformers' own code could have)
            before = [cache.layers[i].conv_states[0].clone() for i in gdn]
            tok = fast(tok, cache=cache).logits.argmax(-1)
            slot = fast._linattn_model_plan
            lo, buf = slot.layout, slot.last
            # (fp32: the call advanced transformers' conv states in place, `_conv_io`; bf16: the buffers' path)
            assert (slot.plan.w_io_at is not None) == (dtype == torch.float32)
            for i, old in zip(gdn, before):
                lay, new = lo.layers[i], cache.layers[i].conv_states[0]
                assert new.dtype == dtype and new.shape == old.shape
                assert torch.equal(new[..., :-1], old[..., 1:]), (step, i)
                if dtype == torch.float32:
                    continue   # (the plan's buffer holds no windows: test_conv_states_in_place_same_bits_as_buffers)
                win = buf[lo.n_state + lay.w_off:lo.n_state + lay.w_off + math.prod(lay.wshape)].view(lay.wshape)
                assert torch.equal(new[..., -1], win[..., -1].to(dtype)), (step, i)
                assert torch.equal(new[..., 1:], win.to(dtype)), (step, i)   # (the plan's whole window)
    assert calls.model == 7


def _gdn_pair(dtype, gdn: dict, layers=("linear_attention",) * 3 + ("full_attention",)):
    """(unpatched, kernelized) Qwen3.5 with the GDN shape `gdn` changes."""
    cfg = transformers.Qwen3_5TextConfig(**ATTN, **{**GDN, **gdn}, num_hidden_layers=len(layers),
                                         layer_types=list(layers))
    return pd.perturbed_pair(transformers.Qwen3_5ForCausalLM, cfg, dtype, moved=("norm", "A_log", "dt_bias"),
                             scaled=("q_proj", "k_proj"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("gdn", [{}, dict(linear_key_head_dim=10, linear_value_head_dim=7),
                                 dict(linear_conv_kernel_dim=3),
                                 dict(linear_conv_kernel_dim=5, linear_key_head_dim=10, linear_value_head_dim=7)])
@pytest.mark.parametrize("B", [1, 3])
def test_conv_states_in_place_same_bits_as_buffers(B, gdn, dtype, monkeypatch):
    """fp32 / fp64: the compiled call reads each GDN layer's conv state `[B, C, K]` as transformers keeps it and
    advances it in place to `[old[1:] | x]` (kernelize_plan._conv_io, csrc/decode.c conv_io): after every token the
    logits, recurrent states and conv states are the buffers' path's (the plan's windows in, a memmove and a column
    copy after, `_shift_in`) bit for bit. C = 96 channels (whole blocks of the vectorised K = 4 pass) and 68 (a
    partial last block), K = 3 and 5 (the generic loop), batch 1 and 3."""
    calls = CompiledDecodeCalls(monkeypatch)
    model = _gdn_pair(dtype, gdn)[1]
    got, want = pd.conv_io_decoded(model, B, 6, lambda step: True), pd.conv_io_decoded(model, B, 6, lambda step: False)
    assert calls.model == 12
    for step, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g[0], w[0]), step
        for a, b in zip(g[1] + g[2], w[1] + w[2]):
            assert torch.equal(a, b), step


def test_conv_states_in_place_and_buffers_paths_take_over_from_each_other(monkeypatch):
    """Tokens by the buffers' path (the layers' conv states views of its stack), then in place, then the buffers'
    path again (the stack it left is stale: it must not be read), then a conv state that is not contiguous (the
    buffers' path), then in place again: the same bits as in place throughout, and transformers' logits."""
    ref, model = _gdn_pair(torch.float32, {})
    mode = [False, False, True, True, False, False, True, True]
    want = pd.conv_io_decoded(model, 2, len(mode), lambda step: True)
    got = pd.conv_io_decoded(model, 2, len(mode), lambda step: mode[step])
    for step, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g[0], w[0]) and all(map(torch.equal, g[1] + g[2], w[1] + w[2])), step
    # a conv state replaced by a non-contiguous one between tokens: the buffers' path, then in place again
    ids = pd.prompt(2, 5)
    with torch.no_grad():
        caches = [m(ids, use_cache=True).cache for m in (model, ref)]
        tok = ids[:, -1:]
        for step in range(5):
            if step == 2:
                for c in caches:
                    cs = c.layers[1].conv_states[0]
                    c.layers[1].conv_states[0] = torch.empty(cs.shape[0], cs.shape[2], cs.shape[1]).transpose(1, 2)
                    c.layers[1].conv_states[0].copy_(cs)
            lg = [m(tok, cache=c).logits for m, c in zip((model, ref), caches)]
            assert (model._linattn_model_plan.plan.w_io_at is None) == (step == 2), step
            assert pd.close(lg[0], lg[1]), step
            tok = lg[1].argmax(-1)


def test_state_views_made_once_per_buffer(monkeypatch):
    """The GDN layers' recurrent states are views of the step's buffer, of which two alternate: a token given the
    buffer of the token before last gives the layers the views made of it then (the same objects) while no one else
    held them; a view held elsewhere is not given again (nor its buffer written) and keeps its values. The logits
    and states stay the unpatched model's."""
    import weakref

    ref, fast = _pair()
    ids = pd.prompt(2, 5)
    calls = CompiledDecodeCalls(monkeypatch)
    refs, reused = [], []
    with torch.no_grad():
        caches = [m(ids, use_cache=True).cache for m in (fast, ref)]
        tok = ids[:, -1:]
        for step in range(8):
            lg = [m(tok, cache=c).logits for m, c in zip((fast, ref), caches)]
            assert pd.close(lg[0], lg[1]), step
            tok = lg[1].argmax(-1)
            cur = caches[0].layers[0].recurrent_states[0]
            reused.append(step >= 2 and refs[step - 2]() is cur)
            refs.append(weakref.ref(cur))   # (not a reference: one would stop the reuse)
            del cur
            if step == 4:
                held = caches[0].layers[2].recurrent_states[0]
                snap = held.clone()
    assert calls.model == 8
    assert reused == [False, False, True, True, True, True, False, True]
    assert torch.equal(held, snap) and held is not caches[0].layers[2].recurrent_states[0]
    for a, b in zip(caches[0].layers, caches[1].layers):
        if hasattr(a, "recurrent_states"):
            assert pd.close(a.recurrent_states[0], b.recurrent_states[0])
            assert pd.close(a.conv_states[0], b.conv_states[0])
        else:
            assert pd.close(a.keys, b.keys) and pd.close(a.values, b.values)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_decoded_token_returns_transformers_output_object(arch, monkeypatch):
    """A compiled token's output is built without the output class's constructor (`kernelize_plan._output_maker`):
    the object the unpatched model returns, field for field: its class, its attributes in field order (None but the
    logits and the cache), its items and their order, indexing by name and position, the tuple, attributes set
    afterwards, and the pytree spec."""
    import torch.utils._pytree as pytree

    ref, fast = _pair(arch=arch)
    ids = pd.prompt(2, 5)
    calls = CompiledDecodeCalls(monkeypatch)
    with torch.no_grad():
        caches = [m(ids, use_cache=True).cache for m in (fast, ref)]
        got, want = (m(ids[:, -1:], cache=c) for m, c in zip((fast, ref), caches))
    assert calls.model == 1
    assert type(got) is type(want)
    assert list(vars(got)) == list(vars(want))
    assert [k for k, v in vars(got).items() if v is not None] == [k for k, v in vars(want).items() if v is not None]
    assert list(got.keys()) == list(want.keys()) == ["logits", "cache"]
    assert got.cache is got["cache"] is got[1] is caches[0] and got.logits is got["logits"] is got[0]
    assert pd.close(got.logits, want.logits) and len(got.to_tuple()) == len(want.to_tuple()) == 2
    assert pytree.tree_flatten(got)[1] == pytree.tree_flatten(want)[1]
    for out in (got, want):
        out.loss = torch.zeros(())
    assert list(got.keys()) == list(want.keys()) == ["logits", "cache", "loss"]


def test_output_maker_builds_what_the_class_builds():
    """`_output_maker(cls)(logits, cache)` equals `cls(logits=logits, cache=cache)` for every output class a
    described architecture returns; a class it cannot mimic (a field with another default) gets its constructor."""
    import dataclasses

    from linattn.hf import kernelize_plan as kp

    logits, cache = torch.randn(2, 1, 5), transformers.DynamicCache()
    for cls in {a.output_class() for a in kp._ARCHITECTURES.values()}:
        got, want = kp._output_maker(cls)(logits, cache), cls(logits=logits, cache=cache)
        assert type(got) is cls and list(vars(got).items()) == list(vars(want).items()), cls
        assert list(got.items()) == list(want.items()), cls

    @dataclasses.dataclass
    class Odd(transformers.modeling_outputs.CausalLMOutputWithPast):
        extra: object = None

        def __post_init__(self):
            super().__post_init__()
            self.extra = "set by the class"

    got = kp._output_maker(Odd)(logits, cache)
    assert got.extra == "set by the class" and got.logits is logits and got.cache is cache


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2)])
def test_a_thread_count_change_repoints_the_plan(before, after, monkeypatch):
    """torch.set_num_threads between tokens re-points the kernelized model's plan (its and its block plans' thread
    count) instead of rebuilding it; the next tokens' logits are bit for bit those of a plan built at the new count
    (a second kernelized model of the same weights, its plan dropped when the count changes)."""
    from linattn.hf import kernelize_plan as kp

    ref, fast = _pair()
    _, twin = _pair()
    assert all(torch.equal(a, b) for a, b in zip(fast.state_dict().values(), twin.state_dict().values()))
    builds = []
    build = kp._build
    monkeypatch.setattr(kp, "_build", lambda *a: builds.append(a[2]) or build(*a))
    threads = torch.get_num_threads()
    ids = pd.prompt(2, 5)
    try:
        torch.set_num_threads(before)
        with torch.no_grad():
            caches = [m(ids, use_cache=True).cache for m in (fast, twin)]
            toks = [ids[:, -1:]] * 2
            for _ in range(2):
                lg = [m(t, cache=c).logits for m, t, c in zip((fast, twin), toks, caches)]
                assert torch.equal(lg[0], lg[1])
                toks = [x.argmax(-1) for x in lg]
            slot = fast.__dict__["_linattn_model_plan"]
            assert slot.plan is not None and slot.plan.nthreads == before
            twin.__dict__.pop("_linattn_model_plan")   # (the reference: a plan built at the new count)
            torch.set_num_threads(after)
            n_fast = builds.count(fast)
            for _ in range(3):
                lg = [m(t, cache=c).logits for m, t, c in zip((fast, twin), toks, caches)]
                assert torch.equal(lg[0], lg[1])
                toks = [x.argmax(-1) for x in lg]
            assert builds.count(fast) == n_fast and fast.__dict__["_linattn_model_plan"] is slot
            assert [p.nthreads for p in (slot.plan, *slot.keep[0])] == [after] * (1 + len(slot.keep[0]))
            assert twin.__dict__["_linattn_model_plan"].plan.nthreads == after and builds.count(twin) == 2
    finally:
        torch.set_num_threads(threads)


def test_the_guard_prefetches_the_described_tensors_and_follows_a_rebuild(monkeypatch):
    """The kernelized model's guard asks for the lines of every described tensor (its object, TensorImpl, storage)
    on each token; a `.data =` swap of a copied weight rebuilds the plan, whose new guard's list holds the new
    storage; the logits are unchanged by the prefetch (the same token with it and without it, bit for bit)."""
    _, fast = _pair()
    ids = pd.prompt(2, 5)
    with torch.no_grad():
        cache = fast(ids, use_cache=True).cache
        fast(ids[:, -1:], cache=cache)
        slot = fast.__dict__["_linattn_model_plan"]
        guard = slot.guard
        if guard.prefetch is None:
            pytest.skip("no compiled prefetch")
        lines = set(guard.prefetch.addresses())
        assert all({id(t) & ~63, t._cdata & ~63, (t.untyped_storage()._cdata + 16) & ~63} <= lines
                   for t in guard.tensors)
        calls = []
        real = guard.prefetch
        monkeypatch.setattr(guard, "prefetch", lambda: calls.append(1) or real())
        monkeypatch.setattr(guard, "words", None)   # (the Python check: the compiled words' call reads no list)
        tok = ids[:, -1:]
        c2 = copy.deepcopy(cache)
        with_pf = fast(tok, cache=cache).logits
        assert calls == [1]
        monkeypatch.setattr(guard, "prefetch", None)
        assert torch.equal(fast(tok, cache=c2).logits, with_pf)
        monkeypatch.undo()
        w = fast.model.norm.weight
        w.data = w.data * 1.5
        fast(tok, cache=cache)
        new = fast.__dict__["_linattn_model_plan"].guard
        assert new is not guard and new.prefetch is not None
        assert (w.untyped_storage()._cdata + 16) & ~63 in set(new.prefetch.addresses())


def test_the_logits_buffer_is_reused_only_when_let_go():
    """The token's logits take the memory the token before last returned once the caller let go of them (no
    allocation a token); logits the caller keeps, or a view of them, are never written again."""
    _, fast = _pair()
    ids = pd.prompt(1, 5)
    with torch.no_grad():
        cache = fast(ids, use_cache=True).cache
        tok = ids[:, -1:]
        ptrs, kept = [], []
        for _ in range(6):
            out = fast(tok, cache=cache)
            ptrs.append(out.logits.data_ptr())
            tok = out.logits[:, -1:].argmax(-1)
        assert ptrs[2] == ptrs[4] and ptrs[3] == ptrs[5] and ptrs[4] != ptrs[5]   # (the bench's loop: reused)
        for i in range(6):   # (every output kept, or a view of its logits, or a tensor of their storage)
            out = fast(tok, cache=cache)
            keep = (out.logits, out.logits[0, :, :7], torch.empty(0).set_(out.logits.untyped_storage(), 0, (7,)))
            kept.append((keep[i % 3], out.logits.clone()))
            tok = out.logits[:, -1:].argmax(-1)
        assert all(torch.equal(a, b.view(-1)[:7].view(a.shape) if a.numel() == 7 else b) for a, b in kept)
        assert len({a.data_ptr() for a, _ in kept}) == len(kept)
