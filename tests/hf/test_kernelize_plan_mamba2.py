"""A kernelized Mamba2 decodes through the compiled whole-model plan (hf/kernelize_plan_mamba2.py): through
transformers' `generate`, against the UNPATCHED model (transformers' PyTorch code): greedy tokens identical and
logits within 1e-5 (fp32), sampled tokens with a seed, batch > 1, beam search, transformers' cache objects holding
transformers' values, a cache copied, continued or advanced by transformers' own code between compiled tokens, left
padding, one compiled call per decoded token, the plan rebuilt when a weight it copied is updated in
place, bf16, and what the plan does not compute stepping aside. The block reads and writes transformers' `[P, N]`
states (`state_pn`) with the bits of linattn's `[N, P + 1]` layout, and the cache's state tensor is the plan's."""
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Mamba2ForCausalLM"):
    pytest.skip(f"the installed transformers ({transformers.__version__}) has no Mamba2", allow_module_level=True)

from linattn.cpu import decode as cpu_decode  # noqa: E402
from linattn.hf import kernelize_plan_mamba2 as plan_mamba2  # noqa: E402
from linattn.hf.kernelize_plan_mamba2 import undescribed_reason  # noqa: E402
from tests.helpers import CompiledDecodeCalls  # noqa: E402
from tests.hf import plan_decode as pd  # noqa: E402
from tests.hf.kernelize_models import V, transformers_torch_code  # noqa: E402, F401  (autouse)

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler: the compiled kernels are off")


def _pair(dtype=torch.float32, tied=False, hooked=True, **cfg):
    """(unpatched, kernelized) Mamba2 of 3 layers, 2 groups of B / C; the norms, A_log / dt_bias / D and the conv
    bias moved off their init values."""
    cfg = transformers.Mamba2Config(**{**dict(
        vocab_size=V, hidden_size=32, num_heads=4, head_dim=16, state_size=8, n_groups=2, expand=2, conv_kernel=4,
        num_hidden_layers=3, chunk_size=8, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=tied), **cfg})
    return pd.perturbed_pair(transformers.Mamba2ForCausalLM, cfg, dtype, hooked,
                             moved=("norm", "A_log", "dt_bias", ".D", "conv1d.bias"))


class TestGenerate(pd.GenerateChecks):
    make_pair = staticmethod(_pair)
    COMPILE_PAIR = dict(num_hidden_layers=1)
    BF16_LOGITS = torch.float32   # (as transformers returns them)
    #: the mask enters transformers' prefill only: Mamba2's generate passes none to its one-token steps, which decode
    #: every row from its state through the plan
    LEFT_PADDED_COMPILED = 5

    def described_module(self, fast):
        return fast.backbone.layers[1].mixer.out_proj


@pytest.mark.parametrize("B,T,n,tied", [(1, 1, 12, False), (3, 9, 40, False), (2, 5, 8, True)])
def test_greedy_generate_matches_the_unpatched_model(B, T, n, tied, monkeypatch):
    ref, fast = _pair(tied=tied)
    assert inspect.signature(fast.forward) == inspect.signature(ref.forward)
    pd.check_greedy_generate(ref, fast, B, T, n, monkeypatch)


def test_cache_objects_hold_transformers_values(monkeypatch):
    ref, fast = _pair()
    prompt = pd.prompt(2, 6)
    calls = CompiledDecodeCalls(monkeypatch)
    got, want = (pd.generate(m, prompt, 5).past_key_values for m in (fast, ref))
    assert calls.model == 4
    for lg, lw in zip(got.layers, want.layers):
        assert lg.recurrent_states[0].shape == lw.recurrent_states[0].shape
        torch.testing.assert_close(lg.recurrent_states[0], lw.recurrent_states[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lg.conv_states[0], lw.conv_states[0], rtol=1e-5, atol=1e-6)


def test_a_left_padded_call_steps_aside(monkeypatch):
    """A one-token call given a mask with a zero (a left-padded row) runs transformers' forward: its logits, no
    compiled call."""
    ref, fast = _pair()
    ids = pd.prompt(2, 7)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    calls = CompiledDecodeCalls(monkeypatch)
    with torch.no_grad():
        caches = [m(ids, use_cache=True).cache for m in (fast, ref)]
        step = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
        lg = [m(ids[:, -1:], cache=c, attention_mask=step).logits for m, c in zip((fast, ref), caches)]
    assert calls.model == 0 and pd.close(lg[0], lg[1])


def test_cache_copied_continued_and_advanced_by_transformers_between_calls(monkeypatch):
    pd.check_cache_copied_and_advanced(*_pair(), lambda c: c.layers[1].recurrent_states[0], monkeypatch)


@pytest.mark.parametrize("name", ["backbone.layers.0.norm.weight", "backbone.layers.1.mixer.A_log",
                                  "backbone.layers.2.mixer.in_proj.weight", "backbone.layers.1.mixer.D",
                                  "backbone.layers.0.mixer.norm.weight", "backbone.norm_f.weight"])
def test_in_place_update_of_a_weight_is_read(name, monkeypatch):
    """A weight updated in place between tokens: the next token reads the new value (-exp(A_log), a copy, rebuilds
    the plan; the others are read in place)."""
    pd.check_in_place_update(*_pair(), name, name.endswith("A_log"), monkeypatch)


def test_a_clamped_time_step_steps_aside():
    """transformers clamps dt in its chunked prefill but not in its one-token step: a model with a finite
    time_step_limit is not hooked (the reason is given) and decodes as the unpatched model."""
    ref, fast = _pair(hooked=False, time_step_limit=(0.0, 0.5))
    assert "time_step_limit" in undescribed_reason(fast)
    prompt = pd.prompt(2, 4)
    got, want = pd.generate(fast, prompt, 4), pd.generate(ref, prompt, 4)
    assert torch.equal(got.sequences, want.sequences)


def _block_step(p, x, w_in, S_in, S_shape):
    fn = cpu_decode.block_function(x.dtype)
    w_out, S_out, x_out = torch.empty_like(w_in), torch.empty(S_shape, dtype=x.dtype), torch.empty_like(x)
    cpu_decode.block_step(p, fn, x, w_in, S_in, w_out, S_out, x_out)
    return x_out, S_out, w_out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("B,first", [(1, False), (3, False), (2, True)])
def test_state_in_transformers_layout_has_the_bits_of_the_plan_layout(dtype, B, first):
    """The Mamba2 block with `state_pn` (a head's state [P, N], as transformers keeps it) against the same block in
    linattn's [N, P + 1] layout (the unused z column random): the same output and new state, bit for bit (first:
    no state in, a zero state), for every layer (2 groups, head_dim 16 = the [P, N] loop's 16 rows; 20: a partial
    tile; state 8)."""
    for head_dim in (16, 20):
        model = _pair(dtype, head_dim=head_dim, hidden_size=2 * head_dim)[1]
        desc, mixers = plan_mamba2.describe(model)
        d = desc.embed.weight.shape[1]
        g = torch.Generator().manual_seed(3)
        for bd, mx in zip(desc.blocks, mixers):
            H, P, N, CD, KC = mx.num_heads, mx.head_dim, mx.ssm_state_size, mx.conv_dim, mx.conv_kernel_size
            p_pn, p_np = (plan_mamba2.block_plan(mx, bd, B, d, dtype) for _ in range(2))
            p_np.state_pn = 0
            assert p_pn.state_pn == 1
            x = torch.randn(B, d, dtype=dtype, generator=g)
            w_in = torch.randn(B, CD, KC - 1, dtype=dtype, generator=g)
            S_pn = torch.randn(B, H, P, N, dtype=dtype, generator=g)
            S_np = torch.cat([S_pn.transpose(-1, -2), torch.randn(B, H, N, 1, dtype=dtype, generator=g)], -1)
            x_pn, Sn_pn, w_pn = _block_step(p_pn, x, w_in, None if first else S_pn.contiguous(), (B, H, P, N))
            x_np, Sn_np, w_np = _block_step(p_np, x, w_in, None if first else S_np.contiguous(), (B, H, N, P + 1))
            assert torch.equal(x_pn, x_np) and torch.equal(w_pn, w_np)
            assert torch.equal(Sn_pn, Sn_np[..., :P].transpose(-1, -2))


def test_the_cache_state_is_the_plan_state(monkeypatch):
    """After a compiled token each layer's state tensor is a view of the plan's new state buffer (no copy), the
    next token reads it in place, and transformers' own step continues from it (a copy in place of its own)."""
    ref, fast = _pair()
    calls = CompiledDecodeCalls(monkeypatch)
    prompt = pd.prompt(2, 5)
    with torch.no_grad():
        caches = [m(prompt, use_cache=True).cache for m in (fast, ref)]
        for t in range(3):
            tok = prompt[:, t:t + 1]
            got, want = (m(tok, cache=c, use_cache=True).logits for m, c in zip((fast, ref), caches))
            assert pd.close(got, want)
            states = [lay.recurrent_states[0] for lay in caches[0].layers]
            base = states[0].untyped_storage().data_ptr()
            assert all(s.untyped_storage().data_ptr() == base for s in states)
        assert calls.model == 3
        # transformers' own step from the plan's state (the hook steps aside under grad), then the plan again
        with torch.enable_grad():
            got, want = (m(prompt[:, 3:4], cache=c, use_cache=True).logits for m, c in zip((fast, ref), caches))
        assert calls.model == 3 and pd.close(got.detach(), want.detach())
        got, want = (m(prompt[:, 4:5], cache=c, use_cache=True).logits for m, c in zip((fast, ref), caches))
        assert calls.model == 4 and pd.close(got, want)
        for lg, lw in zip(caches[0].layers, caches[1].layers):
            torch.testing.assert_close(lg.recurrent_states[0], lw.recurrent_states[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("B", [1, 3])
def test_conv_states_in_place_same_bits_as_buffers(B, monkeypatch):
    """Mamba2's blocks (kind 5, the conv over xBC after z) read and advance transformers' conv states in place:
    bit for bit the buffers' path, and the unpatched model's logits (`plan_decode.check_conv_states_in_place`)."""
    ref, model = _pair()
    pd.check_conv_states_in_place(ref, model, B, monkeypatch)
