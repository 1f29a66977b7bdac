"""KDA (Kimi Delta Attention) blocks in the compiled decode (csrc/decode_kda.h, block kind 4): a model mixing KDA
with Gated DeltaNet and softmax layers decodes in ONE compiled call per token, within 4x the per-block PyTorch
path's own error of that path in fp64, in fp32 / fp64 / bf16 and int8 / int4 weights, for the layer's options (the
bounded gate, low-rank and sigmoid output gates, grouped value heads, no convolution, no output norm); its caches
continue on every other path and back; the plan's guard sees KDA's own parameters and options."""
import pytest
import torch

from linattn.cpu import decode as cpu_decode
from linattn.quant import quantize, quantized_modules
from tests.models import decode_kinds as dk

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler: the compiled kernels are off")

CASES = {
    "defaults": {},
    "bounded gate, low-rank sigmoid output gate": dict(gate_lower_bound=-5.0, output_gate_rank=8, gate_act="sigmoid"),
    "grouped value heads, l2-clamp, no conv": dict(n_value_heads=4, qk_norm="l2-clamp", short_conv=False),
    "no output norm, gate rank 4": dict(output_norm=False, gate_rank=4),
}


def _model(dtype=torch.float32, **kw):
    return dk.hybrid("kda", dtype, kw)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("B,prefill", [(1, 1), (3, 5)])
def test_hybrid_with_kda_decodes_in_one_compiled_call(case, dtype, B, prefill, monkeypatch):
    model = _model(dtype, **CASES[case])
    dk.check_one_call_per_token(model, dtype, B, prefill, monkeypatch, layers=(0, 2))


def test_the_state_decays_per_key_channel():
    """The compiled state of a KDA layer after a token is the PyTorch path's, which decays each key row by its own
    gate: a plan that decayed by one gate per head (Gated DeltaNet's) would differ here."""
    model = _model(torch.float64)
    layer = model.blocks[0].mixer
    with torch.no_grad():   # gates far apart across the key channels
        layer.dt_bias.copy_(torch.linspace(-6, 4, layer.dt_bias.numel(), dtype=torch.float64))
    ids = dk.ids_of(2, 6)
    _, cache = dk.decode(model, ids, 2)
    _, tcache = dk.decode(dk.pytorch_twin(model), ids, 2)
    dk.assert_same_entries(cache, tcache, (0, 2), 1e-12)


@pytest.mark.parametrize("case", ["defaults", "bounded gate, low-rank sigmoid output gate"])
def test_handoff_between_the_whole_model_plan_the_block_plans_and_pytorch(case, monkeypatch):
    dk.check_handoff(_model(**CASES[case]), monkeypatch, kind_layers=(0, 2))


def test_block_plans_alone_match_the_pytorch_path(monkeypatch):
    """`compiled_decode = False` on the model: every block is its own compiled call (KDA's too)."""
    dk.check_block_plans_alone(_model(**CASES["bounded gate, low-rank sigmoid output gate"]), monkeypatch)


def _in_place_conv_weight(model):
    with torch.no_grad():
        model.blocks[0].mixer.k_conv.weight.mul_(1.5)   # fused into the plan's conv weights (a copy)


def _a_log(model):
    with torch.no_grad():
        model.blocks[2].mixer.A_log.add_(0.5)   # -exp(A_log) is a copy


def _bound(model):
    model.blocks[0].mixer.gate_lower_bound = -3.0


def _gate_act(model):
    model.blocks[2].mixer.o_norm.gate_act = "sigmoid"


def _output_gate(model):
    model.blocks[0].mixer.g_proj = None


def _switch(model):
    model.blocks[0].mixer.compiled_decode = False


def _hook(model):
    model.blocks[2].mixer.f_proj[1].register_forward_hook(lambda *a: None)


CAUSES = {"in-place fused conv weight": _in_place_conv_weight, "A_log in place": _a_log,
          "gate_lower_bound": _bound, "gated norm's act": _gate_act, "output gate removed": _output_gate,
          "switch": _switch, "hook on the gate": _hook}


@pytest.mark.parametrize("cause", list(CAUSES))
def test_guard_invalidates_for_each_kda_cause(cause, monkeypatch):
    dk.check_guard(_model(), CAUSES[cause], monkeypatch)


def test_in_place_update_of_a_weight_read_in_place_needs_no_rebuild():
    """f_proj's two stages (the first a part of the fused input projection) and dt_bias are read in place: an
    in-place update between two tokens of one cache is seen without a rebuild (a new cache rebuilds anyway:
    `new_cache` clears the fused weights)."""
    def update(m):
        m.blocks[0].mixer.f_proj[1].weight.mul_(2.0)
        m.blocks[2].mixer.f_proj[0].weight.mul_(1.5)
        m.blocks[2].mixer.dt_bias.add_(1.0)

    dk.check_update_in_place_without_rebuild(_model(), update)


@pytest.mark.parametrize("mode,group", [("int8", None), ("int4", 32)])
def test_quantized_weights(mode, group, monkeypatch):
    """Every KDA matrix stored quantized (16 value heads and ranks of 32: int4's shape rules take b_proj and both
    low-rank stages), the fused first stage, f_proj's and g_proj's second stages and o_proj each in its format."""
    model = dk.hybrid("kda", torch.float32, dict(output_gate_rank=32, gate_rank=32, n_value_heads=16),
                      pattern=(0, 0), d_model=64, ffn_hidden=64)
    q = quantize(model, mode, group_size=group, compute="fp32", activations="float")
    names = set(quantized_modules(q))
    for i in (0, 1):
        assert {f"blocks.{i}.mixer.{n}" for n in ("b_proj", "f_proj.0", "f_proj.1", "g_proj.0", "g_proj.1")} <= names
    dk.check_quantized(q, monkeypatch)


def test_generate_matches_the_pytorch_path():
    dk.check_generate(_model(**CASES["bounded gate, low-rank sigmoid output gate"]))


def test_rope_steps_aside(monkeypatch):
    """A KDA layer with RoPE is not what the compiled step computes: the per-block PyTorch path decodes it (no
    compiled call for its model), with the same logits as the twin."""
    dk.check_steps_aside(_model(rope=True), monkeypatch)


def test_hostile_values_propagate():
    """Gates at their extremes (decay 1 and decay 0: dt_bias -1e4 and +1e4, softplus past its threshold) give the
    PyTorch path's values; a NaN token (its embedding row) makes its batch row's later logits NaN, and only its."""
    model = _model(torch.float64)
    with torch.no_grad():
        model.blocks[0].mixer.dt_bias[:5] = -1e4
        model.blocks[0].mixer.dt_bias[5:9] = 1e4
    dk.assert_matches_twin(model, dk.ids_of(2, 7), 3, tol=1e-10)
    dk.check_nan_token(model)


@pytest.mark.parametrize("op", dk.CACHE_OPS)
def test_cache_operations_between_tokens(op, monkeypatch):
    dk.check_cache_op(_model(**CASES["defaults"]), op, monkeypatch)


def test_two_threads_give_the_same_bits():
    """Batch 4 with heads big enough that the heads' loop and the products run on 2 threads."""
    model = dk.hybrid("kda", torch.float32, dict(head_dim=64, n_value_heads=4), pattern=(0, 1, 0), d_model=256,
                      n_heads=4)
    dk.check_threads(model)
