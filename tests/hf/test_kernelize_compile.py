"""linattn.hf.kernelize under torch.compile (issue 45.3): a kernelized model compiles with fullgraph=True and gives
its eager logits (<= 1e-5 relative, fp32); kernelize never changes transformers' modeling modules, so an unpatched
model of a kernelized class keeps transformers' functions and compiles as before. Compiling is slow on the CPU:
a tiny Gated DeltaNet hybrid (patched, then unpatched) and a tiny Mamba2 (patched); every architecture by the
cheap identity check."""
import importlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

from linattn.hf.kernelize import _ADAPTERS, SERVED_CLASSES, kernelize, torch_fallbacks  # noqa: E402
from tests.hf.kernelize_models import ARCHS, build, ids as _ids, maxdiff as _maxdiff, pair  # noqa: E402


def _kernel_bindings():
    """{(modeling module, name): the object bound there} for every kernel name kernelize knows."""
    out = {}
    for module_name in sorted({m for m, _ in SERVED_CLASSES.values()}):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name in _ADAPTERS:
            if hasattr(module, name):
                out[(module_name, name)] = getattr(module, name)
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_kernelize_leaves_transformers_modules_alone(arch):
    """After kernelize, every kernel name of every modeling module is bound to the very object it was before,
    and an unpatched twin's mixers run transformers' class forward (no instance attribute)."""
    before = _kernel_bindings()
    ref = build(arch)
    report = kernelize(build(arch))
    assert report.patched
    assert _kernel_bindings() == before
    for name in report.patched:
        assert "forward" not in ref.get_submodule(name).__dict__


def _compiled_vs_eager(model, ids):
    with torch.no_grad():
        eager = model(ids, use_cache=False).logits
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True)(ids, use_cache=False).logits
    return _maxdiff(compiled, eager) / eager.abs().max().item()


@pytest.mark.parametrize("arch", ["qwen3_5"])
def test_fullgraph_compile_patched_and_unpatched_after(arch):
    """The kernelized model compiles with fullgraph=True (its compiled logits = its eager ones), and then an
    unpatched model of the same classes, in the same process, does too (its compiled logits = its eager ones,
    = transformers' own: checked against the patched ones)."""
    with torch_fallbacks():          # the unpatched GDN runs transformers' PyTorch code, also with fla installed
        ref, fast, _ = pair(arch)
        ids = _ids(40, 19, 1)
        assert _compiled_vs_eager(fast, ids) <= 1e-5, arch
        assert _compiled_vs_eager(ref, ids) <= 1e-5, arch
        with torch.no_grad():
            a, b = ref(ids, use_cache=False).logits, fast(ids, use_cache=False).logits
        assert _maxdiff(a, b) <= 2e-5 * max(1.0, a.abs().max().item())
    torch._dynamo.reset()


def test_fullgraph_compile_mamba2_patched():
    """Mamba2 (the short convolution and the scan through linattn, the backbone's own forward): compiled = eager."""
    _, fast, _ = pair("mamba2")
    assert _compiled_vs_eager(fast, _ids(41, 19, 1)) <= 1e-5
    torch._dynamo.reset()


def test_packed_positions_inside_compile_fail_loudly():
    """Packing needs data-dependent shapes, so it is not served in a compiled graph: restarting position_ids raise
    at run time there (never a silent mix of documents); continuing ones run and match eager."""
    _, fast, _ = pair("qwen3_5")
    ids = _ids(42, 12, 1)
    compiled = torch.compile(fast, fullgraph=True)
    with torch.no_grad():
        eager = fast(ids, position_ids=torch.arange(12)[None], use_cache=False).logits
        out = compiled(ids, position_ids=torch.arange(12)[None], use_cache=False).logits
        assert _maxdiff(out, eager) <= 1e-5 * eager.abs().max().item()
        with pytest.raises(RuntimeError, match="not served inside torch.compile"):
            compiled(ids, position_ids=torch.cat([torch.arange(5), torch.arange(7)])[None], use_cache=False)
    torch._dynamo.reset()
