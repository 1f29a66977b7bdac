"""Softmax-attention blocks in the compiled decode (models/decode_plan.py, csrc/decode.c kind 2): a hybrid
LanguageModel (Gated DeltaNet and softmax layers) decodes through ONE compiled call per token, with the logits of the
per-block PyTorch path within bounds computed from an fp64 reference, its KV caches valid for every other path
(copied, reordered, snapshot and restored, rows at different lengths), and a test per guard invalidation cause that
the softmax block adds."""
import copy

import pytest
import torch
import torch.nn as nn

from linattn.cpu import decode as cpu_decode
from linattn.layers import KVCache, RotaryEmbedding
from linattn.models import LanguageModel, LMConfig, decode_plan
from tests.helpers import CompiledDecodeCalls, torch_decode_twin
from tests.models import decode_kinds as dk

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler: the compiled kernels are off")


def _model(dtype=torch.float32, mixer="softmax", every=2, layers=4, **softmax_kw):
    """Layers of Gated DeltaNet with a softmax (or `mixer`) layer in every `every`; softmax_kw its options."""
    torch.manual_seed(0)
    kw = dict(heads=4, n_kv_heads=2, head_dim=16, output_gate=True, kv_chunk=4)
    kw.update(softmax_kw)
    mixers = [mixer if (i + 1) % every == 0 else "gated-deltanet" for i in range(layers)]
    cfg = LMConfig(vocab_size=dk.VOCAB, d_model=32, n_layers=layers, n_heads=2, head_dim=16, mixer=mixers,
                   ffn_hidden=48, mixer_kwargs={mixer: kw}, window=kw.pop("window", None) if mixer == "swa" else None)
    model = LanguageModel(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n or "A_log" in n:
                p.add_(0.1 * torch.randn_like(p))
            if "q_proj" in n or "k_proj" in n:   # sharper attention: the softmax's max-subtraction matters
                p.mul_(3.0)
    return model.to(dtype).eval()


CASES = {
    "gqa+silu gate": {},
    "sigmoid gate": dict(gate_act="sigmoid"),
    "no gate, qk norm": dict(output_gate=False, qk_norm=True),
    "one kv head, no rope": dict(n_kv_heads=1, rope=False),
    "sliding window": dict(mixer="swa", window=3, kv_chunk=2),
    # (the scores by whole 64-byte lines where the head is a multiple of one: fp64's 8 elements, not fp32's 16)
    "head dim 24": dict(head_dim=24),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("B,prefill", [(1, 1), (3, 5)])
def test_hybrid_decodes_in_one_compiled_call(case, dtype, B, prefill, monkeypatch):
    """Every decoded token is one compiled call (T = 1 prompts too, the KV cache growing past its chunk several
    times); its logits are within 4x the per-block PyTorch path's own error of the fp64 reference, and the greedy
    tokens agree with the per-block path's (fp32 / fp64); the KV caches hold the per-block path's keys and values."""
    kw = dict(CASES[case])
    mixer = kw.pop("mixer", "softmax")
    model = _model(dtype, mixer, **kw)
    if "rope" in kw:
        assert all(b.mixer.rope is None for b in model.blocks[1::2])
    twin = torch_decode_twin(model)
    twin.compiled_decode = False
    ref = torch_decode_twin(model, torch.float64)
    ids = dk.ids_of(B, prefill + 11)
    calls = CompiledDecodeCalls(monkeypatch)
    got, cache = dk.decode(model, ids, prefill)
    assert calls.model == ids.shape[1] - prefill
    want, twin_cache = dk.decode(twin, ids, prefill)
    ref64, _ = dk.decode(ref, ids, prefill)
    assert calls.model == ids.shape[1] - prefill   # (the twins take the per-block path)
    dk.assert_within_bound(got, ref64, (want.double() - ref64).abs().max().item(), dtype)
    if dtype != torch.bfloat16:
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    tol = dict(rtol=0, atol=0) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    for i in range(1, len(model.blocks), 2):
        kv, tkv = cache.layer(i, "mixer")["kv"], twin_cache.layer(i, "mixer")["kv"]
        assert (kv.length, kv.start) == (tkv.length, tkv.start) and kv.k.dtype == dtype
        assert cache.layer(i, "mixer").offset == twin_cache.layer(i, "mixer").offset == ids.shape[1]
        if dtype != torch.bfloat16:   # (bf16: a rounding of the same value may land one bf16 step apart)
            torch.testing.assert_close(kv.k[:, :kv.length], tkv.k[:, :tkv.length], **tol)
            torch.testing.assert_close(kv.v[:, :kv.length], tkv.v[:, :tkv.length], **tol)


def test_the_per_block_path_continues_the_compiled_caches():
    """Tokens decoded by the compiled call, then by the per-block path on the same cache (and back): the same
    logits as the per-block path throughout (its KV entries and offsets are what the general path expects)."""
    model = _model()
    twin = torch_decode_twin(model)
    twin.compiled_decode = False
    ids = dk.ids_of(2, 12)
    with torch.no_grad():
        cache, tcache = model(ids[:, :3], use_cache=True).cache, twin(ids[:, :3], use_cache=True).cache
        for t in range(3, 12):
            model.compiled_decode = t not in (6, 7, 10)
            got, want = model(ids[:, t:t + 1], cache=cache).logits, twin(ids[:, t:t + 1], cache=tcache).logits
            torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("op", ["deepcopy", "reorder", "snapshot-restore", "rows at different lengths",
                                "remove rows"])
def test_cache_operations_between_tokens(op, monkeypatch):
    """A cache copied, reordered, snapshot and restored, joined by rows at another position (per-row offsets,
    left-padded KV caches) or left by rows between compiled tokens: the per-block path's logits, and a copy's
    decoding never changes the original's KV cache."""
    model = _model(n_kv_heads=1)
    twin = torch_decode_twin(model)
    twin.compiled_decode = False
    ids = dk.ids_of(3, 10)
    calls = CompiledDecodeCalls(monkeypatch)

    def run(m, cache, tok):
        return m(tok, cache=cache).logits

    with torch.no_grad():
        caches = [m(ids[:, :4], use_cache=True).cache for m in (model, twin)]
        for m, c in zip((model, twin), caches):
            run(m, c, ids[:, 4:5])
        tok = ids[:, 5:6]
        if op == "deepcopy":
            copies = [copy.deepcopy(c) for c in caches]
            before = caches[0].layer(1, "mixer")["kv"].k[:, :5].clone()   # (the rows past length: uninitialised)
            outs = [run(m, c, ids[:, 6:7]) for m, c in zip((model, twin), copies)]
            torch.testing.assert_close(outs[0], outs[1], rtol=2e-5, atol=2e-5)
            kv = caches[0].layer(1, "mixer")["kv"]
            assert torch.equal(kv.k[:, :5], before) and kv.length == 5
        elif op == "reorder":
            for c in caches:
                c.reorder(torch.tensor([2, 0, 0, 1]))
            tok = tok[[2, 0, 0, 1]]
        elif op == "snapshot-restore":
            snaps = [c.snapshot() for c in caches]
            for m, c in zip((model, twin), caches):
                run(m, c, tok)
                run(m, c, tok)
                c.restore(snaps[caches.index(c)])
        elif op == "rows at different lengths":
            late = [m(ids[:1, :2], use_cache=True).cache for m in (model, twin)]
            for c, extra in zip(caches, late):
                c.insert_rows(extra.snapshot())
            assert isinstance(caches[0].layer(1, "mixer").offset, torch.Tensor)
            tok = torch.cat([tok, ids[:1, 2:3]])
        else:
            for c in caches:
                c.remove_rows([1])
            tok = tok[[0, 2]]
        n0 = calls.model
        for _ in range(4):
            outs = [run(m, c, tok) for m, c in zip((model, twin), caches)]
            torch.testing.assert_close(outs[0], outs[1], rtol=2e-5, atol=2e-5)
            tok = outs[1].argmax(-1)
        assert calls.model == n0 + 4


def test_generate_greedy_and_sampled_tokens_match():
    """`generate` (greedy and sampled with a seed) gives the per-block path's tokens."""
    model = _model()
    twin = torch_decode_twin(model)
    twin.compiled_decode = False
    ids = dk.ids_of(1, 4)[0]
    for kw in (dict(temperature=0.0), dict(temperature=0.8, top_k=20, generator=5)):
        assert torch.equal(model.generate(ids, 12, **kw), twin.generate(ids, 12, **kw))


def _replace_rope(model):
    model.blocks[1].mixer.rope = RotaryEmbedding(model.blocks[1].mixer.head_dim, base=500.0)


def _replace_q_norm_weight(model):
    n = model.blocks[1].mixer.q_norm
    n.weight = nn.Parameter(n.weight.detach() * 1.5)


def _scale(model):
    model.blocks[1].mixer.scale = 0.1


def _switch_off(model):
    model.blocks[1].mixer.compiled_decode = False


def _hook(model):
    model.blocks[1].mixer.k_proj.register_forward_hook(lambda *a: None)


def _gate_act(model):
    model.blocks[1].mixer.gate_act = "sigmoid"


def _kv_heads_module(model):
    m = model.blocks[1].mixer
    old = m.v_proj
    m.v_proj = nn.Linear(old.in_features, old.out_features, bias=False)


SOFTMAX_CAUSES = {"a replaced RoPE module": _replace_rope, "a replaced q-norm weight": _replace_q_norm_weight,
                  "the softmax scale": _scale, "the softmax layer's switch": _switch_off,
                  "a hook on k_proj": _hook, "the gate's activation": _gate_act,
                  "a replaced v_proj": _kv_heads_module}


@pytest.mark.parametrize("cause", list(SOFTMAX_CAUSES))
def test_guard_invalidates_for_each_softmax_cause(cause):
    """Each change of a softmax block the plan depends on invalidates its guard; the next tokens give the per-block
    path's logits (rebuilt, or on the usual path)."""
    model = _model(qk_norm=True)
    ids = dk.ids_of(2, 8)
    dk.decode(model, ids, 3)
    guard = model._model_plan.guard
    assert guard.valid()
    SOFTMAX_CAUSES[cause](model)
    assert not guard.valid()
    twin = torch_decode_twin(model)
    twin.compiled_decode = False
    got, _ = dk.decode(model, ids, 3)
    want, _ = dk.decode(twin, ids, 3)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_in_place_update_of_a_weight_read_in_place_needs_no_rebuild():
    """q_proj and the q-norm weight are read in place: updated in place, the next token reads the new values
    without a rebuild."""
    model = _model(qk_norm=True)
    twin = torch_decode_twin(model)
    twin.compiled_decode = False
    ids = dk.ids_of(2, 8)
    with torch.no_grad():
        cache, tcache = model(ids[:, :3], use_cache=True).cache, twin(ids[:, :3], use_cache=True).cache
        model(ids[:, 3:4], cache=cache)
        twin(ids[:, 3:4], cache=tcache)
        built = decode_plan.rebuilds[0]
        for m in (model, twin):
            m.blocks[1].mixer.q_proj.weight.mul_(0.5)
            m.blocks[1].mixer.q_norm.weight.add_(0.25)
        for t in range(4, 8):
            got, want = model(ids[:, t:t + 1], cache=cache).logits, twin(ids[:, t:t + 1], cache=tcache).logits
            torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    assert decode_plan.rebuilds[0] == built


def test_softmax_entries_the_step_does_not_write_step_aside(monkeypatch):
    """A KV cache of another layout (batch rows, heads) or an offset that disagrees with it: no compiled call,
    and the usual path's error or result."""
    model = _model()
    ids = dk.ids_of(2, 6)
    calls = CompiledDecodeCalls(monkeypatch)
    with torch.no_grad():
        cache = model(ids[:, :3], use_cache=True).cache
        lc = cache.layer(1, "mixer")
        lc["offset"] = lc.offset + 1   # not the KV cache's length
        decode_plan.model_step(model, ids[:, 3:4], cache, 0)
        assert calls.model == 0
        assert decode_plan.model_step(model, ids[:, 3:4], cache, 0) is None
        lc["offset"] = lc.offset - 1
        kv = lc["kv"]
        lc["kv"] = KVCache(chunk=4)
        lc["kv"].k, lc["kv"].v, lc["kv"].length = kv.k[:, :, :1].contiguous(), kv.v[:, :, :1].contiguous(), 3
        assert decode_plan.model_step(model, ids[:, 3:4], cache, 0) is None
        lc["kv"] = kv
        assert decode_plan.model_step(model, ids[:, 3:4], cache, 0) is not None
    assert calls.model == 1


def test_hostile_values_propagate():
    """A NaN in a cached key reaches the outputs of the rows that see it and no other row; huge query weights
    (scores ~1e4: the max-subtraction) stay finite."""
    model = _model()
    ids = dk.ids_of(2, 6)
    with torch.no_grad():
        cache = model(ids[:, :3], use_cache=True).cache
        cache.layer(1, "mixer")["kv"].k[1, 0, 0, 0] = float("nan")
        out = model(ids[:, 3:4], cache=cache).logits
        assert torch.isfinite(out[0]).all() and torch.isnan(out[1]).all()
        big = _model()
        big.blocks[1].mixer.q_proj.weight.mul_(1e3)
        got, _ = dk.decode(big, ids, 2)
        twin = torch_decode_twin(big)
        twin.compiled_decode = False
        want, _ = dk.decode(twin, ids, 2)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_long_context_on_two_threads():
    """A KV cache long enough for the heads to run in parallel (2 threads): the per-block path's logits."""
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        model = _model(kv_chunk=256)
        twin = torch_decode_twin(model)
        twin.compiled_decode = False
        ids = dk.ids_of(2, 1100)
        got, _ = dk.decode(model, ids, 1096)
        want, _ = dk.decode(twin, ids, 1096)
    finally:
        torch.set_num_threads(n)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_a_model_of_softmax_layers_only_and_a_trimmed_kv_view(monkeypatch):
    """Every layer softmax (no recurrent state in the step's buffers); a KV cache that is a strided view (as
    `remove_rows` trims left padding to): one compiled call per token, the per-block path's logits."""
    model = _model(every=1, layers=2)
    twin = torch_decode_twin(model)
    twin.compiled_decode = False
    ids = dk.ids_of(2, 9)
    calls = CompiledDecodeCalls(monkeypatch)
    got, cache = dk.decode(model, ids, 3)
    want, _ = dk.decode(twin, ids, 3)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    assert calls.model == 6
    with torch.no_grad():
        kv = cache.layer(0, "mixer")["kv"]
        kv.k, kv.v = kv.k[:, :kv.length + 2], kv.v[:, :kv.length + 2]   # strided views, room for two rows
        assert not kv.k.is_contiguous()
        tcache = copy.deepcopy(cache)
        tok = ids[:, -1:]
        got, want = model(tok, cache=cache).logits, twin(tok, cache=tcache).logits
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    assert calls.model == 7


class _ZeroCentredNorm(nn.Module):
    """transformers' Qwen3-Next / Qwen3.5 RMSNorm: x / rms(x) * (1 + weight), in fp32."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(0.1 * torch.randn(dim)), eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())).type_as(x)


class _GatedAttention(nn.Module):
    """Qwen3.5's attention written from its formulas for one decoded token (the reference): q_proj rows per head
    [query D | gate D], zero-centred q/k norms, RoPE on the first `rot` channels with fp32 angles, softmax over the
    cached keys in fp32, o * sigmoid(gate); keys and values in linattn's KVCache."""

    def __init__(self, d, H, G, D, rot, base=10000.0):
        super().__init__()
        self.H, self.G, self.D, self.rot = H, G, D, rot
        self.q_proj, self.k_proj = nn.Linear(d, H * 2 * D, bias=False), nn.Linear(d, G * D, bias=False)
        self.v_proj, self.o_proj = nn.Linear(d, G * D, bias=False), nn.Linear(H * D, d, bias=False)
        self.q_norm, self.k_norm = _ZeroCentredNorm(D), _ZeroCentredNorm(D)
        self.inv_freq = 1.0 / (base ** (torch.arange(0, rot, 2, dtype=torch.float) / rot))

    def _rope(self, x, pos):
        ang = pos.float()[:, None, None, None] * self.inv_freq   # [B, 1, 1, rot/2], fp32 as transformers
        c, s = torch.cat([ang.cos()] * 2, -1).to(x.dtype), torch.cat([ang.sin()] * 2, -1).to(x.dtype)
        r, rest = x[..., :self.rot], x[..., self.rot:]
        half = torch.cat([-r[..., self.rot // 2:], r[..., :self.rot // 2]], -1)
        return torch.cat([r * c + half * s, rest], -1)

    def forward(self, x, lc):
        B, H, G, D = x.shape[0], self.H, self.G, self.D
        q, gate = self.q_proj(x).view(B, 1, H, 2 * D).split(D, -1)
        q, k = self.q_norm(q), self.k_norm(self.k_proj(x).view(B, 1, G, D))
        v = self.v_proj(x).view(B, 1, G, D)
        pos = torch.full((B,), lc.offset, dtype=torch.long)
        q, k = self._rope(q, pos), self._rope(k, pos)
        kv = lc.get("kv")
        if kv is None:
            kv = lc["kv"] = KVCache(chunk=4)
        ks, vs, _ = kv.append(k, v)
        ks, vs = ks.repeat_interleave(H // G, 2), vs.repeat_interleave(H // G, 2)
        w = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q.float(), ks.float()) * D ** -0.5, -1)
        o = torch.einsum("bhqk,bkhd->bqhd", w, vs.float()).to(x.dtype).reshape(B, 1, H * D)
        lc["offset"] = lc.offset + 1
        return self.o_proj(o * torch.sigmoid(gate.reshape(B, 1, H * D)))

    def description(self):
        return decode_plan.AttentionDescription(
            q_proj=self.q_proj, k_proj=self.k_proj, v_proj=self.v_proj, o_proj=self.o_proj, heads=self.H,
            kv_heads=self.G, head_dim=self.D, head_dim_v=self.D, scale=self.D ** -0.5, window=None,
            q_norm=self.q_norm, k_norm=self.k_norm, norm_offset=1, rot=self.rot, inv_freq=self.inv_freq.double(),
            rope_f32=True, rope_scale=1.0, gate="q", g_proj=None, gate_act="sigmoid", kv_chunk=4)


class _QwenLikeModel(nn.Module):
    """A Gated DeltaNet block then a Qwen3.5-style attention block (pre-norm, SwiGLU), described for the plan
    through an explicit `AttentionDescription`, as a transformers model's description would be."""

    def __init__(self, d=32):
        super().__init__()
        from linattn.layers import RMSNorm, SwiGLU
        from linattn.models.registry import build_mixer
        torch.manual_seed(4)
        self.tok = nn.Embedding(dk.VOCAB, d)
        self.mixers = nn.ModuleList([build_mixer("gated-deltanet", d, 2), _GatedAttention(d, 4, 2, 16, rot=8)])
        self.pre = nn.ModuleList([RMSNorm(d) for _ in range(2)])
        self.post = nn.ModuleList([RMSNorm(d) for _ in range(2)])
        self.mlps = nn.ModuleList([SwiGLU(d, 48) for _ in range(2)])
        self.out_norm, self.out = RMSNorm(d), nn.Linear(d, dk.VOCAB, bias=False)
        with torch.no_grad():
            self.mixers[1].q_proj.weight.mul_(3.0)
            self.mixers[1].k_proj.weight.mul_(3.0)

    def forward(self, ids, cache):
        x = self.tok(ids)
        for i, (mixer, n1, n2, mlp) in enumerate(zip(self.mixers, self.pre, self.post, self.mlps)):
            h = x + mixer(n1(x), cache.layer(i, "mixer")) if i else x + mixer(n1(x), cache=cache.layer(i, "mixer"))
            x = h + mlp(n2(h))
        return self.out(self.out_norm(x))

    def decode_description(self):
        blocks = []
        for m, n1, n2, f in zip(self.mixers, self.pre, self.post, self.mlps):
            att = m.description() if isinstance(m, _GatedAttention) else None
            kind = None if att is not None else m.fast_step_kind()
            blocks.append(decode_plan.BlockDescription(m, kind, n1, n2, "swiglu", f.w_gate_up, f.w_down,
                                                       modules=(n1, n2, f, f.w_gate_up, f.w_down), attention=att))
        return decode_plan.ModelDescription(self.tok, blocks, self.out_norm, self.out)


def test_transformers_conventions_partial_rotary_q_gate_zero_centred_norms(monkeypatch):
    """The description's transformers conventions (the gate in q_proj's rows, zero-centred q/k norms precomputed
    as 1 + w, partial rotary with fp32 angles, a sigmoid gate) against a reference written from Qwen3.5's formulas,
    token by token (T = 1 prompt, batch 2, the KV cache grown past its chunk), and an in-place update of a
    zero-centred norm weight (copied into the plan as 1 + w) rebuilds the plan."""
    from linattn.layers import Cache
    model = _QwenLikeModel().eval()
    calls = CompiledDecodeCalls(monkeypatch)
    ids = dk.ids_of(2, 10)
    with torch.no_grad():
        ref_cache, fast_cache = Cache(2), Cache(2)
        for t in range(10):
            if t == 6:
                model.mixers[1].k_norm.weight.add_(0.3)
            ref = model(ids[:, t:t + 1], ref_cache)
            got = decode_plan.model_step(model, ids[:, t:t + 1], fast_cache, 0)
            assert got is not None
            torch.testing.assert_close(got[0], ref, rtol=1e-5, atol=1e-5)
    assert calls.model == 10
    kv, rkv = fast_cache.layer(1, "mixer")["kv"], ref_cache.layer(1, "mixer")["kv"]
    torch.testing.assert_close(kv.k[:, :kv.length], rkv.k[:, :rkv.length], rtol=1e-5, atol=1e-6)
