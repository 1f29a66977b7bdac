"""The guard's words (cpu/guard.py, csrc/guard.c): the layout found on this torch and Python reads what Python
reports; each recorded tensor and dict is checked when recorded; the call says "unchanged" only while every word
is, for each way a tensor's data pointer or version or a dict's version changes; nothing without the kernels."""
import ctypes

import pytest
import torch

from linattn.cpu import build as cbuild, guard as cg
from linattn.models import decode_plan

DICT_VERSION = decode_plan._probe_dict_version()


def _layout():
    fn = cg.function() if DICT_VERSION is not None else None
    lay = cg.layout(DICT_VERSION) if fn is not None else None
    if lay is None:
        pytest.skip("no compiled guard, no dict version reader, or this torch / Python layout not recognised")
    return lay


def _u(addr, n=8):
    return (ctypes.c_uint64 if n == 8 else ctypes.c_uint16 if n == 2 else ctypes.c_uint32).from_address(addr).value


def test_the_layout_reads_what_python_reports():
    """Each offset, read on tensors and dicts made here (other shapes, dtypes, offsets than the search's), gives
    what Python reports: a wrong offset would read another word."""
    dv, cd, so, do, oo, no, dt, vc, cnt = _layout()
    base = torch.randn(100, dtype=torch.float64)
    for t in (base[7:37].view(5, 6), torch.nn.Parameter(torch.randn(9)), torch.zeros(3, 4, dtype=torch.bfloat16)):
        impl = t._cdata
        assert _u(id(t) + cd) == impl
        st = _u(impl + so)
        assert st == t.untyped_storage()._cdata and _u(st + do) == t.untyped_storage().data_ptr()
        assert _u(impl + oo) == t.storage_offset() and _u(impl + no) == t.numel()
        assert _u(st + do) + _u(impl + oo) * t.element_size() == t.data_ptr()
        for _ in range(2):
            assert _u(_u(impl + vc) + cnt, 4) == t._version
            t.data.add_(1) if isinstance(t, torch.nn.Parameter) else t.add_(1)
    codes = {_u(torch.empty(2, dtype=d)._cdata + dt, 2) for d in (torch.float32, torch.float64, torch.bfloat16,
                                                                   torch.int8, torch.uint8, torch.float16)}
    assert len(codes) == 6
    d = {"x": 1}
    v = _u(id(d) + dv)
    assert v == DICT_VERSION(d)
    d["y"] = 2
    assert _u(id(d) + dv) == DICT_VERSION(d) != v


def _guard(tensors, copied, dicts=()):
    _layout()
    g = cg.word_guard(list(dicts), DICT_VERSION, tensors, copied)
    assert g is not None
    return g


@pytest.mark.parametrize("change", ["in place", ".data =", "set_", "storage resized", "swap_tensors", "narrowed",
                                    "offset", "dict write"])
def test_the_words_see_each_change(change):
    """Every way a guarded tensor's data pointer or version or a dict's version changes makes the call say
    "changed"; an untouched guard says "unchanged" every time."""
    base = torch.randn(40)
    t = base[4:20]
    p = torch.nn.Parameter(torch.randn(6, 4))
    d = {"w": p}
    g = _guard([t, p], [t, p], [d])
    assert g() and g()
    with torch.no_grad():
        if change == "in place":
            p.mul_(2)
        elif change == ".data =":
            p.data = p.data * 2
        elif change == "set_":
            t.set_(torch.randn(16))
        elif change == "storage resized":
            base.untyped_storage().resize_(base.untyped_storage().nbytes() * 64)
        elif change == "swap_tensors":
            torch.utils.swap_tensors(p, torch.nn.Parameter(p.detach().clone()))
        elif change == "narrowed":
            p.data = p.data.view(-1)[:1]   # (same data pointer: the words see the numel, the check would not)
        elif change == "offset":
            t.set_(base.untyped_storage(), 5, (16,))
        elif change == "dict write":
            d["b"] = None
    assert not g()


def test_a_dict_version_taken_again():
    d, t = {"a": 1}, torch.randn(3)   # (held: the caller keeps every object alive)
    g = _guard([t], [], [d])
    d["a"] = 2
    assert not g()
    g.dicts_again([DICT_VERSION(d)])
    assert g()


@pytest.mark.parametrize("kind", ["sparse", "meta", "subclass", "empty", "inference"])
def test_unusual_tensors_give_no_words(kind):
    """A tensor that is not a plain strided CPU tensor with a storage, or a copied one without a version counter:
    no words (the Python check alone)."""
    _layout()

    class Sub(torch.Tensor):
        pass

    if kind == "sparse":
        t = torch.randn(3, 3).to_sparse()
    elif kind == "meta":
        t = torch.empty(3, device="meta")
    elif kind == "subclass":
        t = torch.randn(3).as_subclass(Sub)
    elif kind == "empty":
        t = torch.empty(0)
    else:
        with torch.inference_mode():
            t = torch.randn(3)
    assert cg.word_guard([], DICT_VERSION, [t], [t]) is None
    assert cg.word_guard([], DICT_VERSION, [torch.randn(2)], []) is not None


def test_a_dict_subclass_gives_no_words():
    class D(dict):
        pass

    _layout()
    assert cg.word_guard([D(a=1)], DICT_VERSION, [], []) is None


def test_no_words_without_the_kernels(monkeypatch):
    monkeypatch.setattr(cbuild, "enabled", lambda: False)
    monkeypatch.setattr(cg, "enabled", lambda: False)
    assert cg.function() is None
    assert cg.word_guard([], DICT_VERSION, [torch.randn(2)], []) is None


def test_the_call_keeps_the_gil():
    """The words' call holds the GIL (a PYFUNCTYPE): no other thread runs between its compares and its reads."""
    _layout()
    fn = cg.function()
    assert fn._flags_ & ctypes._FUNCFLAG_PYTHONAPI
