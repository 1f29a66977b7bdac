"""The fused compiled decoding step (cpu/csrc/decode.c, cpu/decode.py): one C call between the fused projection
and o_proj for DeltaNet, Gated DeltaNet, EFLA and linear attention (identity / elu+1 / relu maps, no gate, RetNet
or scalar gate). Checked against the PyTorch fast step (LINATTN_CPU_KERNELS=0), the general path and an fp64 copy
of the layer (the chunk form in fp64), over many steps, with the compiled step counted so the comparisons
cannot pass by taking the same path twice."""
import copy

import pytest
import torch

from linattn.cpu import decode as cpu_decode
from linattn.layers import LayerCache
from linattn.models import LanguageModel, LMConfig
from linattn.models.registry import build_mixer
from tests.helpers import perturbed_mixer

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler: the compiled kernels are off")

# mixer name -> extra layer options; every covered combination of map, gate, conv, grouped heads, output gate
CASES = {
    "deltanet": {},
    "deltanet-clamp-noconv": dict(mixer="deltanet", l2norm_convention="clamp", short_conv=False),
    "gated-deltanet": {},
    "gated-deltanet-gva": dict(mixer="gated-deltanet", n_value_heads=4),
    "efla": {},
    "efla-adaptive": {},
    "efla-loose": {},
    "efla-noq": dict(mixer="efla", q_l2norm=False, qkv_bias=True),
    "linear-elu+1": {},
    "linear-identity": {},
    "linear-relu": dict(mixer="linear-relu", short_conv=True, output_gate=True),
    "retnet": {},
    "mamba2-gla": {},
    "linear-elu+1-scalar-gva": dict(mixer="linear-elu+1", gate="scalar", n_value_heads=4, short_conv=True),
}


class Count:
    """Counts the compiled steps (monkeypatched entry points of cpu/decode.py; a whole-model step counts once)."""

    def __init__(self, monkeypatch):
        self.n = 0
        for name in ("delta_step", "linear_step", "block_step"):
            inner = getattr(cpu_decode, name)

            def counted(*a, _inner=inner, **k):
                self.n += 1
                return _inner(*a, **k)

            monkeypatch.setattr(cpu_decode, name, counted)
        model_function = cpu_decode.model_function

        def counted_model(dtype):
            fn = model_function(dtype)

            def counted(*a):
                self.n += 1
                return fn(*a)
            return counted

        monkeypatch.setattr(cpu_decode, "model_function", counted_model)


def _layer(case, d=32, H=2, dtype=torch.float32):
    kw = dict(CASES[case])
    return perturbed_mixer(kw.pop("mixer", case), d, H, dtype, **kw)


def _decode(layer, x, prefill=0):
    cache, outs = LayerCache(), []
    with torch.no_grad():
        if prefill:
            outs.append(layer(x[:, :prefill], cache=cache))
        for t in range(prefill, x.shape[1]):
            outs.append(layer(x[:, t:t + 1], cache=cache))
    return torch.cat(outs, 1), cache


def _torch_then_compiled(layer, x, prefill, monkeypatch):
    """The layer decoded by the PyTorch step (kernels off), then by the compiled one: (ref, ref_cache), (got,
    cache) and the number of compiled steps taken."""
    count = Count(monkeypatch)
    monkeypatch.setenv("LINATTN_CPU_KERNELS", "0")
    ref = _decode(layer, x, prefill)
    monkeypatch.setenv("LINATTN_CPU_KERNELS", "1")
    return ref, _decode(layer, x, prefill), count.n


def _entries(cache):
    out = {}
    for k, v in cache.items():
        vals = v if isinstance(v, tuple) else (v,)
        out[k] = [t for t in vals if isinstance(t, torch.Tensor)]
    return out


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("prefill", [0, 3])
def test_compiled_step_equals_torch_step_and_forward(case, prefill, monkeypatch):
    """24 steps (state carried), B=2: outputs and every cache entry as the PyTorch fast step's (fp32 rounding),
    and the outputs as the full forward's."""
    layer = _layer(case)
    x = torch.randn(2, 24, 32, generator=torch.Generator().manual_seed(1))
    count = Count(monkeypatch)
    monkeypatch.setenv("LINATTN_CPU_KERNELS", "0")
    ref, ref_cache = _decode(layer, x, prefill)
    assert count.n == 0
    monkeypatch.setenv("LINATTN_CPU_KERNELS", "1")
    got, cache = _decode(layer, x, prefill)
    assert count.n == x.shape[1] - prefill
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    a, b = _entries(cache), _entries(ref_cache)
    assert set(a) == set(b)
    for k in a:
        for t, u in zip(a[k], b[k]):
            assert t.dtype == u.dtype and t.shape == u.shape, k
            torch.testing.assert_close(t, u, rtol=1e-5, atol=1e-5, msg=k)
    with torch.no_grad():
        full = layer(x)
    torch.testing.assert_close(got, full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", ["deltanet", "gated-deltanet", "efla"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_state_rows_not_a_whole_line(case, dtype, monkeypatch):
    """Heads of 20 channels (a state row of 80 / 160 bytes, not a whole number of 64-byte lines: the state update's
    plain stores, where 16-channel heads take its streamed lines): 12 steps, B=2, outputs and states as the PyTorch
    fast step's."""
    layer = _layer(case, d=40, dtype=dtype)
    assert layer.head_dim == 20
    x = torch.randn(2, 12, 40, generator=torch.Generator().manual_seed(3), dtype=dtype)
    (ref, ref_cache), (got, cache), steps = _torch_then_compiled(layer, x, 2, monkeypatch)
    assert steps == 10
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    torch.testing.assert_close(cache.state, ref_cache.state, rtol=tol, atol=tol)


@pytest.mark.parametrize("case", ["gated-deltanet-gva", "efla-adaptive", "linear-elu+1-scalar-gva", "retnet"])
def test_compiled_step_against_fp64(case, monkeypatch):
    """fp32 compiled decoding vs an fp64 copy of the layer run by the general chunk form; and the fp64 compiled
    step (also compiled) vs the same to fp64 rounding."""
    layer = _layer(case)
    ref64 = copy.deepcopy(layer).double()
    x = torch.randn(1, 40, 32, generator=torch.Generator().manual_seed(2))
    count = Count(monkeypatch)
    with torch.no_grad():
        want = ref64(x.double())
    got, _ = _decode(layer, x)
    got64, _ = _decode(ref64, x.double())
    assert count.n == 80
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got64, want, rtol=1e-10, atol=1e-11)


def test_t1_and_empty_cache_then_general_path_continues(monkeypatch):
    """One compiled step from an empty cache (T=1), then the general path (prefill of 4 tokens) continues from
    the cache it left: the full forward's values."""
    for case in ("gated-deltanet", "linear-elu+1-scalar-gva"):
        layer = _layer(case)
        x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(3))
        count = Count(monkeypatch)
        cache = LayerCache()
        with torch.no_grad():
            o1 = layer(x[:, :1], cache=cache)
            o2 = layer(x[:, 1:], cache=cache)
            full = layer(x)
        assert count.n == 1
        torch.testing.assert_close(torch.cat([o1, o2], 1), full, rtol=1e-4, atol=1e-5)


def test_off_switch_and_rope_take_the_torch_step(monkeypatch):
    count = Count(monkeypatch)
    x = torch.randn(1, 3, 32)
    monkeypatch.setenv("LINATTN_CPU_KERNELS", "0")
    _decode(_layer("gated-deltanet"), x)
    monkeypatch.setenv("LINATTN_CPU_KERNELS", "1")
    torch.manual_seed(0)
    _decode(build_mixer("gated-deltanet", 32, 2, rope=True).eval(), x)   # RoPE: the PyTorch fast step
    torch.manual_seed(0)
    _decode(build_mixer("linear-elu+1", 32, 2, gate="diagonal").eval(), x)   # diagonal gate: PyTorch
    assert count.n == 0
    _decode(_layer("gated-deltanet"), x)
    assert count.n == 3


def test_compiled_step_leaves_an_earlier_state_alone(monkeypatch):
    """The step writes fresh buffers (a cache copied for beam search may share the old ones)."""
    for case in ("gated-deltanet", "linear-relu"):
        layer = _layer(case)
        x = torch.randn(1, 4, 32)
        cache = LayerCache()
        with torch.no_grad():
            layer(x[:, :1], cache=cache)
            layer(x[:, 1:2], cache=cache)
            held = _entries(cache)
            before = {k: [t.clone() for t in v] for k, v in held.items()}
            layer(x[:, 2:3], cache=cache)
        for k in held:
            for t, t0 in zip(held[k], before[k]):
                assert torch.equal(t, t0), k


@pytest.mark.parametrize("case", ["gated-deltanet", "efla", "linear-elu+1"])
def test_nan_reaches_only_later_outputs_like_the_torch_step(case, monkeypatch):
    """A NaN / inf token poisons its own and later outputs only, exactly where the PyTorch step's are poisoned."""
    layer = _layer(case)
    x = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(4))
    x[0, 4, 3] = float("nan")
    x[0, 6, 0] = float("inf")
    got, _ = _decode(layer, x)
    monkeypatch.setenv("LINATTN_CPU_KERNELS", "0")
    ref, _ = _decode(layer, x)
    assert torch.isfinite(got[:, :4]).all()
    torch.testing.assert_close(got[:, :4], ref[:, :4], rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.isnan(got), torch.isnan(ref))


@pytest.mark.parametrize("case", ["deltanet-clamp-noconv", "deltanet"])
@pytest.mark.parametrize("proj", ["k_proj", "q_proj"])
def test_huge_keys_stay_finite_like_the_torch_step(case, proj, monkeypatch):
    """Keys (or queries) whose sum of squares overflows fp32 normalise by the rescaled formula (ops/l2norm.py), not
    to 0/NaN, in both conventions ("clamp", and "rsqrt" through common.h's L2 row)."""
    layer = _layer(case)
    with torch.no_grad():
        getattr(layer, proj).weight.mul_(1e25)  # squares ~1e48: the sum overflows
    x = torch.randn(1, 4, 32, generator=torch.Generator().manual_seed(5))
    got, _ = _decode(layer, x)
    monkeypatch.setenv("LINATTN_CPU_KERNELS", "0")
    ref, _ = _decode(layer, x)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["gated-deltanet", "deltanet"])
def test_six_heads_key_norms_in_fours_and_one_huge_head(case, monkeypatch):
    """6 heads of 16 (the key norms' chains four heads at a time, then the last two alone), one head's keys scaled
    past fp32's squares (its L2 row rescaled, the others' plain, with no division by a scale of 1): 8 steps, B=2,
    outputs and states as the PyTorch fast step's; a NaN in one step's input poisons the same outputs in both."""
    layer = _layer(case, d=96, H=6)
    assert layer.head_dim == 16
    with torch.no_grad():
        layer.k_proj.weight[2 * 16:3 * 16].mul_(1e25)
    x = torch.randn(2, 8, 96, generator=torch.Generator().manual_seed(6))
    x[1, 5, 7] = float("nan")
    (ref, ref_cache), (got, cache), steps = _torch_then_compiled(layer, x, 2, monkeypatch)
    assert steps == 6
    assert torch.equal(torch.isnan(got), torch.isnan(ref)) and torch.isfinite(got[0]).all()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(cache.state, ref_cache.state, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("H,K", [(1, 8), (3, 12), (2, 64)])
def test_conv_window_exact_and_output_as_torch_conv(H, K):
    """The short convolution (kernel 4, SiLU) over C = 24, 108, 384 channels (the AVX2 pass 8 at a time, the last 8
    or 12 by the loop): the new window is the old one shifted with the token, bit for bit, and the step's output is
    the step without a conv on torch's convolution of the same window (fp32 rounding)."""
    cd = cpu_decode
    g = torch.Generator().manual_seed(7)
    B, C = 2, 3 * H * K
    ldy = C + 2 * H + H * K
    y = torch.randn(B, ldy, generator=g)
    w_in, cw, cb = torch.randn(B, C, 3, generator=g), torch.randn(C, 4, generator=g), torch.randn(C, generator=g)
    kw = dict(heads=(H, H, K, K), kind=0, l2conv=0, q_l2=False, l2eps=1e-6, scale=K ** -0.5, beta_mode=0, alpha=None,
              gated=True, neg_a=-torch.rand(H, generator=g) - 0.5, dt_bias=torch.randn(H, generator=g),
              S=0.1 * torch.randn(B, H, K, K, generator=g), norm=(True, torch.rand(K, generator=g) + 0.5, 1e-6),
              has_gate=False)
    o, S, w_out = cd.delta_step(y, conv=(w_in, cw, cb, True), **kw)
    assert torch.equal(w_out, torch.cat([w_in[:, :, 1:], y[:, :C, None]], -1))
    u = torch.nn.functional.silu((torch.cat([w_in, y[:, :C, None]], -1) * cw).sum(-1) + cb)
    o_ref, S_ref, _ = cd.delta_step(torch.cat([u, y[:, C:]], 1).contiguous(), conv=None, **kw)
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(S, S_ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mixer", ["gated-deltanet", "linear-elu+1", "efla"])
def test_model_logits_equal_the_torch_step(mixer, monkeypatch):
    """A 2-layer LM: prefill then 12 decoded tokens; logits as with the PyTorch step and the full forward."""
    torch.manual_seed(0)
    model = LanguageModel(LMConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=2, mixer=mixer)).eval()
    ids = torch.randint(0, 50, (2, 16))
    count = Count(monkeypatch)
    results = []
    for env in ("0", "1"):
        monkeypatch.setenv("LINATTN_CPU_KERNELS", env)
        with torch.no_grad():
            out = model(ids[:, :4], use_cache=True)
            logits = [out.logits]
            for t in range(4, 16):
                out = model(ids[:, t:t + 1], cache=out.cache)
                logits.append(out.logits)
        results.append(torch.cat(logits, 1))
    assert count.n == 12   # one whole-model call per token (tests/cpu/test_decode_model.py)
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        full = model(ids).logits
    torch.testing.assert_close(results[1], full, rtol=1e-4, atol=1e-4)


def test_layer_switch_and_bench_decode_both(tmp_path, capsys, monkeypatch):
    """compiled_decode = False gives the PyTorch step; `bench decode --decode-step both` times each mixer with
    the compiled step and its twin <mixer>+torch."""
    import json

    from linattn.cli import main

    layer = _layer("gated-deltanet")
    layer.compiled_decode = False
    count = Count(monkeypatch)
    _decode(layer, torch.randn(1, 2, 32))
    assert count.n == 0
    rc = main(["bench", "decode", "--N", "16", "--mixers", "softmax,gated-deltanet", "--bandwidth-mib", "16",
               "--d-model", "16",
               "--n-heads", "2", "--n-layers", "1", "--vocab-size", "40", "--decode-steps", "2",
               "--decode-step", "both", "--out", str(tmp_path), "--quiet"])
    assert rc == 0
    models = {r["model"] for r in json.loads((tmp_path / "decode.json").read_text())["records"]}
    assert models == {"softmax", "gated-deltanet", "gated-deltanet+torch"}
    assert count.n > 0   # the compiled model's steps (its twin's are not counted)
    assert "gated-deltanet+torch" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["decode", "conv"])
def test_decode_and_conv_sources_cross_compile_for_aarch64(name, tmp_path):
    """Portable C (no x86 intrinsics): decode.c and conv.c compile for arm64 (compile only, not run)."""
    import shutil
    import subprocess

    from linattn.cpu import build as cbuild

    if shutil.which("aarch64-linux-gnu-gcc") is None:
        pytest.skip("aarch64-linux-gnu-gcc is not installed")
    out = tmp_path / f"{name}.o"
    r = subprocess.run(["aarch64-linux-gnu-gcc", *[f for f in cbuild.BASE_FLAGS if f != "-shared"], "-fopenmp",
                        "-c", str(cbuild.CSRC / f"{name}.c"), "-o", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[:4] == b"\x7fELF"


# -- the whole pre-norm block in one call (fast_decode.block_step, csrc/decode.c linattn_decode_block); the models
# here decode block by block (`compiled_decode = False` on the model: the whole-model step is
# tests/cpu/test_decode_model.py's) --------------------------------------------------------------------------------
BLOCK_MIXERS = ["deltanet", "gated-deltanet", "efla", "efla-adaptive", "linear-elu+1", "linear-relu", "retnet",
                "mamba2-gla"]


def _model(mixer, dtype=torch.float32, **kw):
    """A 2-layer LM whose biases, norm weights and decays are moved off their initial values (seeded)."""
    torch.manual_seed(0)
    model = LanguageModel(LMConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=2, mixer=mixer, **kw)).to(dtype)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n or "A_log" in n or "alpha" in n:
                p.add_(0.1 * torch.randn_like(p))
    model.compiled_decode = False
    return model.eval()


def _torch_twin(model):
    twin = copy.deepcopy(model)
    for m in twin.modules():
        if hasattr(m, "compiled_decode"):
            m.compiled_decode = False
    return twin


def _generate(model, ids, prefill=4):
    with torch.no_grad():
        out = model(ids[:, :prefill], use_cache=True) if prefill else None
        cache = out.cache if out is not None else model.new_cache()
        logits = [out.logits] if out is not None else []
        for t in range(prefill, ids.shape[1]):
            out = model(ids[:, t:t + 1], cache=cache)
            logits.append(out.logits)
    return torch.cat(logits, 1), cache


def _model_entries(cache):
    out = []
    for d in cache.layers:
        for lc in d.values():
            for k in sorted(lc):
                v = lc[k]
                out += [(k, t) for t in (v if isinstance(v, tuple) else (v,)) if isinstance(t, torch.Tensor)]
    return out


class BlockCount:
    def __init__(self, monkeypatch):
        self.n = 0
        inner = cpu_decode.block_step

        def counted(*a):
            self.n += 1
            return inner(*a)

        monkeypatch.setattr(cpu_decode, "block_step", counted)


@pytest.mark.parametrize("mixer", BLOCK_MIXERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("prefill", [0, 4])
def test_block_step_equals_the_torch_step(mixer, dtype, prefill, monkeypatch):
    """Logits and every cache entry (states, conv windows, offsets) as the PyTorch step's, token after token;
    the whole-block call ran for every decoded token of every layer."""
    model = _model(mixer, dtype)
    twin = _torch_twin(model)
    ids = torch.randint(0, 50, (2, 14), generator=torch.Generator().manual_seed(1))
    count = BlockCount(monkeypatch)
    got, cache = _generate(model, ids, prefill)
    assert count.n == 2 * (14 - prefill)
    ref, ref_cache = _generate(twin, ids, prefill)
    assert count.n == 2 * (14 - prefill)
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    a, b = _model_entries(cache), _model_entries(ref_cache)
    assert [k for k, _ in a] == [k for k, _ in b]
    for (k, x), (_, y) in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape, k
        torch.testing.assert_close(x, y, rtol=tol, atol=tol)


def test_block_step_without_ffn_and_with_biases(monkeypatch):
    model = _model("gated-deltanet", ffn="none")
    twin = _torch_twin(model)
    ids = torch.randint(0, 50, (1, 9), generator=torch.Generator().manual_seed(2))
    count = BlockCount(monkeypatch)
    got, _ = _generate(model, ids)
    ref, _ = _generate(twin, ids)
    assert count.n == 2 * 5
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)


def test_block_plan_follows_parameter_updates_batch_and_copies(monkeypatch):
    """An in-place update of any weight the plan reads (an optimizer step), a new batch size, a deepcopy: the
    plan is rebuilt, so the block step keeps the PyTorch step's values."""
    model = _model("linear-elu+1")
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(3))
    _generate(model, ids)
    with torch.no_grad():
        for name in ("blocks.0.ffn.w_down.weight", "blocks.1.norm1.weight", "blocks.0.mixer.o_proj.weight",
                     "blocks.1.mixer.q_proj.weight"):
            dict(model.named_parameters())[name].mul_(1.5)
    twin = _torch_twin(model)
    count = BlockCount(monkeypatch)
    for batch in (ids, ids[:1]):
        got, _ = _generate(model, batch)
        ref, _ = _generate(twin, batch)
        torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)
    clone = copy.deepcopy(model)
    assert all(m._block_plan.plan is None for m in clone.modules() if hasattr(m, "_block_plan"))
    got, _ = _generate(clone, ids)
    ref, _ = _generate(twin, ids)
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)
    assert count.n == 3 * 2 * 4


def test_block_step_steps_aside(monkeypatch):
    """Hooks on a block norm, RoPE, compiled_decode = False, LINATTN_CPU_KERNELS=0, autograd: the usual paths run
    (and still give the same logits)."""
    import torch.nn as nn
    model = _model("gated-deltanet")
    ids = torch.randint(0, 50, (1, 7), generator=torch.Generator().manual_seed(4))
    ref, _ = _generate(_torch_twin(model), ids)
    count = BlockCount(monkeypatch)
    h = model.blocks[0].norm1.register_forward_hook(lambda m, i, o: None)
    got, _ = _generate(model, ids)
    h.remove()
    assert count.n == 3   # block 1 only
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)
    h = nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    _generate(model, ids)
    h.remove()
    monkeypatch.setenv("LINATTN_CPU_KERNELS", "0")
    _generate(model, ids)
    monkeypatch.delenv("LINATTN_CPU_KERNELS")
    out = model(ids[:, :3], use_cache=True)    # grad enabled: the general path
    model(ids[:, 3:4], cache=out.cache).logits.sum().backward()
    assert model.blocks[0].mixer.q_proj.weight.grad is not None
    assert count.n == 3
    rope = _model("gated-deltanet", rope=True)
    _generate(rope, ids)
    assert count.n == 3


def test_block_step_nan_reaches_only_later_tokens(monkeypatch):
    """A NaN embedding at one position: earlier logits unchanged to the bit; the NaN pattern as the PyTorch
    step's, every later logit NaN."""
    model = _model("efla")
    twin = _torch_twin(model)
    ids = torch.randint(0, 50, (1, 10), generator=torch.Generator().manual_seed(5))
    clean, _ = _generate(model, ids)
    for m in (model, twin):
        with torch.no_grad():
            m.embed.weight[ids[0, 6]] = float("nan")
    ids[0, :6] = torch.where(ids[0, :6] == ids[0, 6], (ids[0, 6] + 1) % 50, ids[0, :6])
    clean, _ = _generate(_model("efla"), ids)
    got, _ = _generate(model, ids)
    ref, _ = _generate(twin, ids)
    keep = torch.arange(50) != ids[0, 6]   # the tied head's row of the poisoned token is NaN everywhere
    assert torch.equal(got[:, :6, keep], clean[:, :6, keep])
    assert torch.equal(torch.isnan(got), torch.isnan(ref)) and torch.isnan(got[:, 6:]).all()


@pytest.mark.parametrize("mixer", ["gated-deltanet", "linear-elu+1"])
def test_block_step_after_the_model_changes_dtype(mixer, monkeypatch):
    """A model moved to fp64 mid-generation: the kept fp32 windows and states are converted, as by the PyTorch
    step (and the plan is rebuilt for the new dtype)."""
    model = _model(mixer)
    twin = _torch_twin(model)
    ids = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(6))
    count = BlockCount(monkeypatch)
    outs = []
    for m in (model, twin):
        with torch.no_grad():
            out = m(ids[:, :4], use_cache=True)
            logits = [m(ids[:, t:t + 1], cache=out.cache).logits for t in range(4, 7)]
            m.double()
            logits += [m(ids[:, t:t + 1], cache=out.cache).logits.float() for t in range(7, 10)]
        outs.append(torch.cat(logits, 1))
    assert count.n == 2 * 6
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-5, atol=2e-5)
