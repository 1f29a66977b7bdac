"""The delta rule's layers' one q/k-normalisation option, `qk_norm`: each value against its formula (fp64 reference
of the recurrence), the old options (`l2norm_convention`, EFLA's `q_l2norm`) with a DeprecationWarning, old configs
(a dict written before the option, a saved checkpoint's config) loading with their meaning and no warning."""
import json
import warnings

import pytest
import torch
import torch.nn.functional as F

from linattn import checkpoint as ck
from linattn.errors import LinattnError
from linattn.layers import EFLA, KDA, Comba, DeltaNet, DeltaProduct, GatedDeltaNet
from linattn.models import LanguageModel, LMConfig, build_mixer
from linattn.ops.reference import delta_rule_ref
from tests.helpers import FIXTURES

EPS = 1e-6
FORMULAS = {   # last dimension, fp64
    "l2": lambda x: x / torch.sqrt(x.square().sum(-1, keepdim=True) + EPS),
    "l2-clamp": lambda x: x / x.norm(dim=-1, keepdim=True).clamp_min(EPS),
    "sum": lambda x: x / x.abs().sum(-1, keepdim=True).clamp_min(EPS),
    "none": lambda x: x,
}


def _layer(cls, **kw):
    torch.manual_seed(0)
    return cls(16, 2, **kw).double().eval()


@pytest.mark.parametrize("cls, qk_norm", [(DeltaNet, "l2"), (DeltaNet, "l2-clamp"), (DeltaNet, "sum"),
                                          (GatedDeltaNet, "l2-clamp"), (KDA, "sum"), (EFLA, "l2"), (EFLA, "none")])
@pytest.mark.parametrize("T", [1, 9])
def test_each_value_is_its_formula(cls, qk_norm, T):
    layer = _layer(cls, qk_norm=qk_norm)
    x = torch.randn(2, T, 16, dtype=torch.float64)
    x[0, 0] *= 1e-4   # small q/k rows, where the forms differ most
    with torch.no_grad():
        q, k, v = layer._qkv(x, None)
        got = layer._mix(q, k, v, x, None)
        norm = FORMULAS[qk_norm]
        want, _ = delta_rule_ref(norm(q), norm(k) if layer.normalises_keys else k, v, layer.beta(x),
                                 g=layer.log_gate(x), exact=layer.exact, scale=layer.scale)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_the_forms_differ_where_they_should():
    """Two values that computed the same would make the formula test blind to a mix-up."""
    x = torch.randn(1, 6, 16, dtype=torch.float64)
    outs = {}
    for qk_norm in ("l2", "l2-clamp", "sum"):
        layer = _layer(DeltaNet, qk_norm=qk_norm)
        with torch.no_grad():
            for name, p in layer.named_parameters():
                if name.startswith(("q_proj", "k_proj")):
                    p.mul_(1e-3)   # q/k norms ~1e-3: the eps of the rsqrt form shows
            outs[qk_norm] = layer(x)
    assert (outs["l2"] - outs["l2-clamp"]).abs().max() > 1e-3
    assert (outs["l2"] - outs["sum"]).abs().max() > 1e-3


def test_derived_attributes_are_plain_instance_attributes():
    """The decode plans read these from the layer's __dict__ (and check them by identity)."""
    for cls, qk_norm, want in [(DeltaNet, "l2", (True, "rsqrt", False)), (DeltaNet, "l2-clamp", (True, "clamp", False)),
                               (DeltaNet, "sum", (False, "rsqrt", False)), (EFLA, "l2", (False, "rsqrt", True)),
                               (EFLA, "none", (False, "rsqrt", False))]:
        layer = _layer(cls, qk_norm=qk_norm)
        got = tuple(layer.__dict__[a] for a in ("qk_l2norm", "l2norm_convention", "q_l2norm"))
        assert layer.__dict__["qk_norm"] == qk_norm and got == want, (cls, qk_norm)


@pytest.mark.parametrize("cls, bad", [(DeltaNet, "none"), (DeltaNet, "l1"), (EFLA, "l2-clamp"), (EFLA, "sum"),
                                      (Comba, "sum"), (Comba, "l2-clamp"), (DeltaProduct, "sum")])
def test_a_value_the_layer_cannot_compute_is_refused(cls, bad):
    with pytest.raises(LinattnError, match="qk_norm"):
        cls(16, 2, qk_norm=bad)


@pytest.mark.parametrize("old, new", [
    ((DeltaNet, dict(l2norm_convention="clamp")), dict(qk_norm="l2-clamp")),
    ((DeltaNet, dict(l2norm_convention="rsqrt")), dict(qk_norm="l2")),
    ((DeltaNet, dict(l2norm_convention="clamp", qk_norm="sum")), dict(qk_norm="sum")),
    ((DeltaProduct, dict(l2norm_convention="clamp")), dict(qk_norm="l2-clamp")),
    ((Comba, dict(l2norm_convention="clamp")), dict(qk_norm="l2")),         # Comba always used the rsqrt form
    ((EFLA, dict(l2norm_convention="clamp")), dict(qk_norm="l2")),          # so did EFLA's queries
    ((EFLA, dict(q_l2norm=False)), dict(qk_norm="none")),
    ((EFLA, dict(q_l2norm=True)), dict(qk_norm="l2"))])
def test_old_keyword_arguments_warn_and_keep_their_meaning(old, new):
    cls, kw = old
    with pytest.warns(DeprecationWarning, match="qk_norm"):
        before = _layer(cls, **kw)
    after = _layer(cls, **new)
    assert before.qk_norm == after.qk_norm
    x = torch.randn(2, 5, 16, dtype=torch.float64) * 1e-3
    with torch.no_grad():
        torch.testing.assert_close(before(x), after(x), rtol=0, atol=0)


def test_a_bad_old_convention_is_still_an_error():
    with pytest.raises(LinattnError, match="l2norm_convention"), pytest.warns(DeprecationWarning):
        DeltaNet(16, 2, l2norm_convention="fla")


def _old_config_dict():
    """A model config as code before qk_norm wrote it: every field of the first LMConfig, no l2norm_convention
    (so the clamp form), EFLA's old q_l2norm and DeltaNet's old qk_norm="l2" in mixer_kwargs."""
    d = LMConfig(vocab_size=32, d_model=16, n_layers=3, n_heads=2, mixer=["deltanet", "efla", "kda"],
                 mixer_kwargs={"efla": {"q_l2norm": False}, "deltanet": {"qk_norm": "l2"}}).to_dict()
    del d["l2norm_convention"], d["mixer_names"]
    return json.loads(json.dumps(d))


def test_an_old_config_dict_loads_with_its_meaning_and_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        model = LanguageModel(LMConfig.from_dict(_old_config_dict()))
    assert [b.mixer.qk_norm for b in model.blocks] == ["l2-clamp", "none", "l2-clamp"]
    # and today's default config: the rsqrt form
    new = LanguageModel(LMConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, mixer=["deltanet", "efla"]))
    assert [b.mixer.qk_norm for b in new.blocks] == ["l2", "l2"]


def test_mixer_kwargs_take_the_new_option():
    model = LanguageModel(LMConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, mixer=["deltanet", "efla"],
                                   mixer_kwargs={"deltanet": {"qk_norm": "sum"}, "efla": {"qk_norm": "none"}}))
    assert [b.mixer.qk_norm for b in model.blocks] == ["sum", "none"]
    assert build_mixer("gated-deltanet", 16, 2, qk_norm="l2-clamp").l2norm_convention == "clamp"


def test_a_saved_checkpoint_config_keeps_its_meaning():
    """tests/fixtures/legacy_l2norm: a checkpoint written before the L2 form was a choice (the clamp form)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        c = ck.load_checkpoint(FIXTURES / "legacy_l2norm")
    norms = {b.mixer.qk_norm for b in c.model.blocks if hasattr(b.mixer, "qk_norm")}
    assert norms == {"l2-clamp"}


def test_sum_norm_matches_torch_normalize():
    x = torch.randn(3, 4, 8, dtype=torch.float64)
    torch.testing.assert_close(FORMULAS["sum"](x), F.normalize(x, p=1.0, dim=-1, eps=EPS))
