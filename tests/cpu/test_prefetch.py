"""The guard's prefetch (cpu/prefetch.py, csrc/prefetch.c): the lines of what a tensor's data pointer and version
reads touch, found on this torch and checked against what torch reports; the lines asked for once each, in order;
the compiled call harmless on stale addresses; none without the kernels."""
import ctypes
import gc

import pytest
import torch

from linattn.cpu import build as cbuild, prefetch as pf

LINE = pf.LINE


def _line(a: int) -> int:
    return a & ~(LINE - 1)


def test_version_counter_is_found_and_follows_the_version():
    """The counter's address, read where `version_counter_offset` says, gives the count `_version` reports, shared
    by a detached alias and not by another tensor: a wrong offset would read another word."""
    got = pf.version_counter_offset()
    if got is None:
        pytest.skip("this torch's TensorImpl layout gives no version counter word (the counter lines are skipped)")
    off, cnt = got

    def count(t):
        p = ctypes.c_uint64.from_address(t._cdata + off).value
        return ctypes.c_uint32.from_address(p + cnt).value

    t = torch.zeros(5)[1:4]
    alias, other = t.detach(), torch.ones(5)
    for _ in range(4):
        assert count(t) == t._version == count(alias)
        t.mul_(2)
    other.add_(1)
    assert count(other) == other._version == 1 and t._version == 4


def test_a_tensors_addresses_cover_its_objects():
    t = torch.nn.Parameter(torch.randn(40, 3))
    lines = set(map(_line, pf.tensor_addresses(t)))
    st = t.untyped_storage()._cdata
    assert {_line(id(t)), _line(t._cdata), _line(t._cdata + 47), _line(t._cdata + 144), _line(st + 16)} <= lines
    vc = pf.version_counter_offset()
    if vc is not None:
        p = ctypes.c_uint64.from_address(t._cdata + vc[0]).value
        assert _line(p + vc[1]) in lines
    with torch.no_grad():
        t.data = torch.randn(40, 3)   # (a new storage: a list made after it holds the new one's line)
    assert _line(t.untyped_storage()._cdata + 16) in set(map(_line, pf.tensor_addresses(t)))


def test_a_tensor_without_a_storage_gives_its_other_objects():
    s = torch.randn(3, 3).to_sparse()
    lines = set(map(_line, pf.tensor_addresses(s)))
    assert {_line(id(s)), _line(s._cdata)} <= lines


def test_list_addresses_cover_the_item_array_and_the_items():
    items = [10 ** 30 + i for i in range(40)]
    lines = set(map(_line, pf.list_addresses(items)))
    assert {_line(id(x)) for x in items} <= lines and _line(id(items)) in lines
    # (CPython's item array: its pointer after the object's header and size; 40 items span 5 or 6 lines)
    arr = ctypes.c_void_p.from_address(id(items) + 3 * ctypes.sizeof(ctypes.c_void_p)).value
    assert {_line(a) for a in range(arr, arr + 8 * len(items), 8)} <= lines
    empty = []
    assert pf.list_addresses(empty) == [id(empty)]


def test_prefetcher_asks_for_each_line_once_in_order():
    seen = []

    def fn(n, lines):
        seen.append(list(lines[:n]))

    p = pf.Prefetcher(fn, [200, 130, 0, 64 * 5 + 3, 192, 129, 64 * 5])
    p()
    assert seen == [[192, 128, 320]] and p.addresses() == [192, 128, 320] and p.n == 3


def test_the_compiled_prefetch_runs_on_stale_addresses():
    """A prefetch never faults: freed objects, an unmapped page, the top of the address space."""
    fn = pf.function()
    if fn is None:
        pytest.skip("no C compiler: the compiled kernels are off")
    ts = [torch.randn(8) for _ in range(50)]
    addrs = [a for t in ts for a in pf.tensor_addresses(t)]
    del ts
    gc.collect()
    p = pf.Prefetcher(fn, addrs + [64, 4096, 2 ** 47 - 64, 2 ** 64 - 64])
    p()
    p()


def test_no_prefetcher_without_the_kernels(monkeypatch):
    monkeypatch.setenv(cbuild.ENV_SWITCH, "0")
    assert pf.function() is None and pf.prefetcher(lambda: [id(object())]) is None
