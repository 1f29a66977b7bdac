"""`linattn.cpu.hugepages`: weights moved onto huge-page mappings in place (same objects, same bits, ties kept, the
saved files unchanged), the no-op cases with their reasons, and the hooks that place a model's weights before a
decode plan takes their pointers."""
import copy
import importlib.util
import io
import os
import pickle
import weakref

import pytest
import torch
from torch import nn

from linattn.cpu import available as cpu_available, hugepages as hp
from linattn.models import LanguageModel, LMConfig

HAS_HF = importlib.util.find_spec("transformers") is not None
LINUX_THP = hp.unavailable() is None or hp.unavailable() == "LINATTN_HUGEPAGES=0"
needs_thp = pytest.mark.skipif(not LINUX_THP, reason=f"no huge-page mappings here: {hp.unavailable()}")


@pytest.fixture(autouse=True)
def _every_size(monkeypatch):
    """Every storage placed (the tests' tensors are small), placement on whatever the environment says."""
    monkeypatch.setattr(hp, "MIN_BYTES", 0)
    monkeypatch.delenv("LINATTN_HUGEPAGES", raising=False)


class Tied(nn.Module):
    """An embedding and a head sharing one matrix, a linear layer, a buffer, a non-contiguous view of the
    linear's weight as a second parameter (two tensors, one storage, different offsets / strides)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 24)
        self.lin = nn.Linear(24, 40)
        self.head = nn.Linear(24, 50, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("table", torch.arange(300, dtype=torch.float64).view(20, 15).clone())
        self.slice = nn.Parameter(self.lin.weight.detach()[5:, 1::2], requires_grad=False)

    def forward(self, ids):
        return self.head(torch.tanh(self.lin(self.embed(ids)))[..., :24]) + self.table.sum().float()


def _snapshot(m: nn.Module) -> dict:
    """What placement must keep: each tensor object (by name), its values, requires_grad, and which names share a
    storage."""
    ts = dict(m.named_parameters(remove_duplicate=False)) | dict(m.named_buffers(remove_duplicate=False))
    groups = {}
    for n, t in ts.items():
        groups.setdefault(t.untyped_storage().data_ptr(), set()).add(n)
    return {"objs": {n: id(t) for n, t in ts.items()}, "vals": {n: t.detach().clone() for n, t in ts.items()},
            "grad": {n: t.requires_grad for n, t in ts.items()}, "shared": sorted(map(sorted, groups.values())),
            "layout": {n: (t.shape, t.stride(), t.storage_offset(), t.untyped_storage().nbytes()) for n, t in
                       ts.items()}}


def check_kept(before: dict, m: nn.Module) -> None:
    """Asserts placement kept everything `_snapshot` recorded (bit for bit)."""
    after = _snapshot(m)
    assert after["objs"] == before["objs"] and after["grad"] == before["grad"]
    assert after["shared"] == before["shared"], "a tie was lost or made"
    assert after["layout"] == before["layout"]
    for n, v in before["vals"].items():
        got = after["vals"][n]
        assert got.dtype == v.dtype and torch.equal(got.view(torch.uint8) if got.dim() and got.is_contiguous()
                                                    else got, v.view(torch.uint8) if v.dim() and v.is_contiguous()
                                                    else v), n


def _madvised(addr: int) -> bool:
    """Whether the kernel mapping holding addr asked for huge pages (/proc/self/smaps VmFlags "hg")."""
    hit = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                lo, _, hi = head.partition("-")
                hit = int(lo, 16) <= addr < int(hi, 16)
            elif hit and head == "VmFlags:":
                return "hg" in line.split()[1:]
    return False


@needs_thp
def test_place_module_keeps_objects_values_ties_and_frees_the_old_storage():
    torch.manual_seed(0)
    m = Tied()
    before = _snapshot(m)
    rep = hp.place_module(m)
    check_kept(before, m)
    assert rep.reason is None and rep.placed == 4 and rep.already_bytes == 0   # embed/head, lin w + slice, b, table
    assert rep.placed_bytes == sum(n for _, n in rep.ranges)
    for t in (m.embed.weight, m.lin.weight, m.lin.bias, m.table):   # (all under a huge page: pieces of a chunk)
        addr = t.untyped_storage().data_ptr()
        assert addr % 64 == 0 and hp._ours(addr) and _madvised(addr)
    assert m.head.weight is m.embed.weight
    assert m.slice.untyped_storage().data_ptr() == m.lin.weight.untyped_storage().data_ptr()
    huge = rep.huge_bytes()
    assert huge is None or 0 <= huge <= sum(-(-n // hp.HUGE) * hp.HUGE for _, n in rep.ranges) + 64 * hp.HUGE
    # idempotent: nothing moves again
    ptrs = [t.data_ptr() for t in m.parameters()]
    again = hp.place_module(m)
    assert again.placed == 0 and again.already_bytes == rep.placed_bytes
    assert [t.data_ptr() for t in m.parameters()] == ptrs
    check_kept(before, m)


_OLD_STORAGE_FREED = """
import os, sys
from torch import nn
from linattn.cpu import hugepages as hp

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

big = nn.Linear(4096, 4096, bias=False)   # 64 MiB: torch's memory for it is its own mmap, returned when freed
r0 = rss()
rep = hp.place_module(big)
print(rep.placed_bytes, rss() - r0)
"""


@needs_thp
def test_the_old_storage_is_freed():
    # (in a fresh interpreter: the process-wide resident size of a long test run moves with whatever other tests left)
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _OLD_STORAGE_FREED], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    placed, grew = map(int, out.stdout.split()[-2:])
    assert placed == 64 << 20 and grew < 16 << 20   # 64 MiB moved, 64 MiB freed


@needs_thp
def test_small_storages_share_chunks_that_live_while_a_piece_does(monkeypatch):
    """Storages from MIN_BYTES up to a huge page are 64-byte-aligned pieces of shared chunks, side by side, each its
    own storage of exactly its bytes; a chunk stays mapped while any piece of it lives and is unmapped after; one
    of a huge page or more gets its own mapping; under MIN_BYTES stays."""
    monkeypatch.setattr(hp, "MIN_BYTES", 64 << 10)
    monkeypatch.setattr(hp, "_CHUNK", [None])   # (a fresh chunk: the pieces are side by side from its start)
    m = nn.Module()
    m.a = nn.Parameter(torch.randn(100 << 10 >> 2), requires_grad=False)   # 100 KiB
    m.b = nn.Parameter(torch.randn((1536 << 10) // 4 + 3))                 # 1.5 MiB + 12 bytes
    m.register_buffer("c", torch.arange(256 << 10 >> 3, dtype=torch.float64))
    m.register_buffer("big", torch.ones(3 << 18))                          # 3 MiB: a mapping of its own
    m.register_buffer("tiny", torch.ones(100))                              # stays
    before = _snapshot(m)
    rep = hp.place_module(m)
    check_kept(before, m)
    assert rep.placed == 4 and rep.skipped == {"smaller than min_bytes": 400}
    ptr = {n: t.untyped_storage().data_ptr() for n, t in [*m.named_parameters(), *m.named_buffers()]}
    chunk = hp._CHUNK[0]
    assert ptr["a"] == chunk.start and chunk.start % hp.HUGE == 0
    assert ptr["b"] == ptr["a"] + (100 << 10) and ptr["c"] == ptr["b"] + -(-((1536 << 10) + 12) // 64) * 64
    assert all(hp._ours(ptr[n]) and _madvised(ptr[n]) for n in ("a", "b", "c", "big"))
    assert ptr["big"] % hp.HUGE == 0 and not chunk.start <= ptr["big"] < chunk.start + chunk.length
    assert not hp._ours(ptr["tiny"])
    assert m.b.requires_grad and m.b.untyped_storage().nbytes() == (1536 << 10) + 12
    for n in ("a", "c"):   # each piece a storage of exactly its own bytes
        assert getattr(m, n).untyped_storage().nbytes() == getattr(m, n).numel() * getattr(m, n).element_size()
    ref = weakref.ref(chunk)
    hp._CHUNK[0] = None   # (the allocator lets it go: only the pieces hold it now)
    del chunk
    vals = m.c.clone()
    del m.a, m.b
    assert ref() is not None and torch.equal(m.c, vals)   # a live piece keeps its chunk mapped
    del m
    assert ref() is None   # the last piece gone: the chunk is unmapped


@needs_thp
def test_planted_bugs_fail_the_check(monkeypatch):
    """The check above catches a changed value and a lost tie."""
    m = Tied()
    before = _snapshot(m)
    real = hp._storage_copy

    def flip(storage):
        out = real(storage)
        torch.empty(0, dtype=torch.uint8).set_(out)[0] ^= 1
        return out

    monkeypatch.setattr(hp, "_storage_copy", flip)
    hp.place_module(m)
    with pytest.raises(AssertionError):
        check_kept(before, m)
    monkeypatch.setattr(hp, "_storage_copy", real)
    m = Tied()
    before = _snapshot(m)
    # the slice missed by the grouping and by the holder count (which alone would leave the storage in place)
    monkeypatch.setattr(hp, "_module_tensors", lambda mod: [mod.embed.weight, mod.lin.weight])
    monkeypatch.setattr(hp, "_held_elsewhere", lambda ts: False)
    hp.place_module(m)
    with pytest.raises(AssertionError, match="tie"):
        check_kept(before, m)


def _state_bytes(sd) -> dict:
    return {k: (v.dtype, tuple(v.shape), v.contiguous().view(torch.uint8).view(-1).clone() if v.dim() else v.clone())
            for k, v in sd.items()}


@needs_thp
def test_saved_files_are_the_same(tmp_path):
    """torch.save and safetensors write the same tensors in files of the same size before and after placing."""
    from safetensors.torch import load_file, save_file

    m = Tied()
    del m.slice   # (safetensors refuses views sharing a storage before and after alike)
    m.head.weight = nn.Parameter(m.embed.weight.detach().clone())
    torch.save(m.state_dict(), tmp_path / "a.pt")
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, tmp_path / "a.st")
    rep = hp.place_module(m)
    assert rep.placed >= 4
    torch.save(m.state_dict(), tmp_path / "b.pt")
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, tmp_path / "b.st")
    for ext, load in (("pt", torch.load), ("st", load_file)):
        a, b = tmp_path / f"a.{ext}", tmp_path / f"b.{ext}"
        assert os.path.getsize(a) == os.path.getsize(b)
        ta, tb = load(a), load(b)
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    # a tied model through torch.save: one storage in the file, as before
    t = Tied()
    buf_a = io.BytesIO()
    torch.save(t.state_dict(), buf_a)
    hp.place_module(t)
    buf_b = io.BytesIO()
    torch.save(t.state_dict(), buf_b)
    assert len(buf_a.getvalue()) == len(buf_b.getvalue())


@needs_thp
@pytest.mark.skipif(not HAS_HF, reason="needs transformers (the hf extra)")
def test_save_pretrained_is_the_same(tmp_path):
    from safetensors.torch import load_file

    from linattn.bench.infer import SHAPES
    from linattn.hf.infer_models import qwen35_model

    model = qwen35_model(SHAPES["tiny"], torch.float32, 0)
    model.save_pretrained(tmp_path / "a")
    rep = hp.place_module(model)
    assert rep.placed > 0 and model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(tmp_path / "b")
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert os.path.getsize(tmp_path / "a" / "model.safetensors") == os.path.getsize(tmp_path / "b" /
                                                                                    "model.safetensors")


@needs_thp
def test_to_deepcopy_pickle_backward_and_an_optimiser_step():
    torch.manual_seed(1)
    m = Tied()
    torch.manual_seed(1)
    twin = Tied()   # (not a deepcopy: torch's deepcopy of a Parameter clones it, the slice would stop sharing)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)     # built before placing: it holds the same Parameters
    opt_t = torch.optim.SGD(twin.parameters(), lr=0.1)
    hp.place_module(m)
    ids = torch.tensor([[1, 5, 49, 0]])
    for model, o in ((m, opt), (twin, opt_t)):
        model(ids).square().mean().backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), twin.parameters()))
    assert hp._ours(m.lin.weight.untyped_storage().data_ptr())   # updated in place on the mapping
    assert m.lin.weight.grad is not None and m.head.weight is m.embed.weight
    c = copy.deepcopy(m)
    p = pickle.loads(pickle.dumps(m))
    for other in (c, p):
        assert other.head.weight is other.embed.weight
        assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), other.state_dict().values()))
    d = copy.deepcopy(m).to(torch.float64)
    assert d.lin.weight.dtype == torch.float64 and torch.equal(d.lin.weight, m.lin.weight.double())
    assert not hp._ours(c.lin.weight.untyped_storage().data_ptr())   # a copy is on torch's memory: placed again
    assert hp.place_module(c).placed > 0 and all(hp._ours(t.untyped_storage().data_ptr()) for t in c.parameters())


def test_no_op_cases_say_why(monkeypatch, tmp_path):
    m = nn.Linear(64, 64)
    before = _snapshot(m)
    monkeypatch.setenv("LINATTN_HUGEPAGES", "0")
    rep = hp.place_module(m)
    assert rep.reason == "LINATTN_HUGEPAGES=0" and rep.placed == 0 and sum(rep.skipped.values()) > 0
    assert not hp.switched_on()
    monkeypatch.setenv("LINATTN_HUGEPAGES", "1")
    monkeypatch.setattr(hp.sys, "platform", "darwin")
    assert hp.place_module(m).reason == "not Linux (darwin)"
    monkeypatch.setattr(hp.sys, "platform", "linux")
    mode = tmp_path / "enabled"
    mode.write_text("always madvise [never]\n")
    monkeypatch.setattr(hp, "_THP_MODE", str(mode))
    assert hp.place_module(m).reason == "transparent huge pages are 'never'"
    monkeypatch.setattr(hp, "_THP_MODE", str(tmp_path / "missing"))
    assert "unreadable" in hp.place_module(m).reason
    check_kept(before, m)
    x = hp.empty(1000, torch.float32)
    assert not hp._ours(x.data_ptr()) and x.numel() == 1000
    y = torch.randn(100)
    assert hp.place_copy(y) is y


@needs_thp
def test_refused_small_shared_and_foreign_tensors_stay(monkeypatch):
    m = Tied()
    keep_view = m.table[2:]   # a view held outside the module: the alias must stay an alias
    m.register_buffer("rows", torch.zeros(20, 4).view(80))   # a view whose base only autograd holds: stays too
    m.to_meta = nn.Linear(3, 3, device="meta")
    before = {k: v for k, v in _snapshot(m).items() if k != "vals"}
    rep = hp.place_module(m, min_bytes=48 * 4)
    assert rep.skipped["a view of it is held outside the module"] == 300 * 8 + 80 * 4
    assert rep.skipped["smaller than min_bytes"] == 40 * 4   # the bias
    assert rep.skipped["not a dense CPU tensor"] == 12 * 4   # the meta linear's weight and bias
    keep_view[0, 0] = 123.0
    assert m.table[2, 0] == 123.0
    assert {k: v for k, v in _snapshot(m).items() if k != "vals"} == before
    lib = hp._libc()

    class Refusing:
        def __getattr__(self, name):
            return getattr(lib, name)

        @staticmethod
        def madvise(*args):
            return -1

    monkeypatch.setattr(hp, "_LIBC", Refusing())
    monkeypatch.setattr(hp, "_POOL", {})
    monkeypatch.setattr(hp, "_CHUNK", [None])   # (no chunk mapped before: a piece needs a new one)
    m2 = nn.Linear(32, 32)
    rep2 = hp.place_module(m2)
    assert rep2.placed == 0 and any(k.startswith("mapping refused") for k in rep2.skipped)
    assert not hp._ours(m2.weight.data_ptr())


@needs_thp
def test_empty_and_place_copy_and_the_pool():
    x = hp.empty(3 << 18, torch.float32)   # 3 MiB
    addr = x.data_ptr()
    assert addr % hp.HUGE == 0 and hp._ours(addr) and x.untyped_storage().nbytes() == 3 << 20
    x.fill_(2.0)
    assert _madvised(addr) and float(x.sum()) == 2.0 * (3 << 18)
    del x
    y = hp.empty(3 << 18, torch.float32)   # the freed mapping of the same length, reused
    assert y.data_ptr() == addr
    t = torch.randn(37, 11).t()
    c = hp.place_copy(t)
    assert c is not t and torch.equal(c, t) and c.stride() == t.stride() and hp._ours(c.untyped_storage().data_ptr())
    assert hp.place_copy(c) is c


def _lm():
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, head_dim=16,
                   mixer=["gated-deltanet", "softmax"], ffn_hidden=64, tie_embeddings=True,
                   mixer_kwargs={"softmax": dict(heads=2, n_kv_heads=1, head_dim=16)})
    return LanguageModel(cfg).eval()


def _greedy(model, n=5):
    ids = torch.tensor([[3, 9, 1, 22]])
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache, logits = out.cache, [out.logits[:, -1]]
        for _ in range(n):
            out = model(logits[-1].argmax(-1, keepdim=True), cache=cache)
            cache = out.cache
            logits.append(out.logits[:, -1])
    return torch.stack(logits)


@needs_thp
@pytest.mark.skipif(not cpu_available(), reason="needs the compiled CPU kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_plan_places_the_weights_before_taking_pointers(dtype, monkeypatch):
    """The compiled whole-model step puts the model's weights on huge pages when it builds its plan; the tokens are
    the same bits as an unplaced twin's (LINATTN_HUGEPAGES=0)."""
    model = _lm().to(dtype)
    twin = copy.deepcopy(model)
    got = _greedy(model)
    assert hp._ours(model.embed.weight.untyped_storage().data_ptr())
    assert all(hp._ours(p.untyped_storage().data_ptr()) for p in model.parameters())
    monkeypatch.setenv("LINATTN_HUGEPAGES", "0")
    ref = _greedy(twin)
    assert not hp._ours(twin.embed.weight.untyped_storage().data_ptr())
    assert torch.equal(got, ref)
    assert model._model_plan.plan is not None   # (the compiled step ran)


@needs_thp
@pytest.mark.skipif(not cpu_available(), reason="needs the compiled CPU kernels")
def test_quantize_places_its_integers():
    from linattn.quant import QuantizedLinear, quantize

    model = quantize(_lm(), "int8")
    qs = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    # (every buffer that holds bytes: `_float_like`, the empty tensor that carries the float dtype, holds none)
    assert qs and all(hp._ours(b.untyped_storage().data_ptr()) for m in qs for b in m.buffers() if b.numel())
    assert all(set(m.state_dict()) <= {n for n, b in m.named_buffers() if b.numel()} for m in qs)
    twin = copy.deepcopy(model)
    got = _greedy(model)
    os.environ["LINATTN_HUGEPAGES"] = "0"
    try:
        ref = _greedy(twin)
    finally:
        del os.environ["LINATTN_HUGEPAGES"]
    assert torch.equal(got, ref)


@needs_thp
@pytest.mark.skipif(not (HAS_HF and cpu_available()), reason="needs transformers and the compiled CPU kernels")
def test_kernelize_plan_places_the_weights(monkeypatch):
    from linattn.bench.infer import SHAPES, Runner
    from linattn.hf.infer_models import qwen35_model

    model = qwen35_model(SHAPES["tiny"], torch.float32, 0, kernelized=True)
    twin = qwen35_model(SHAPES["tiny"], torch.float32, 0, kernelized=True)
    outs = []
    for m in (model, twin):
        if m is twin:
            monkeypatch.setenv("LINATTN_HUGEPAGES", "0")
        r = Runner(m)
        r.prefill(torch.tensor([[3, 9, 1, 22, 7]]))
        toks = [r.tok]
        for _ in range(4):
            r.decode(1)
            toks.append(r.tok)
        outs.append(torch.cat(toks, 1))
    assert all(hp._ours(p.untyped_storage().data_ptr()) for p in model.parameters())
    assert not hp._ours(twin.model.embed_tokens.weight.untyped_storage().data_ptr())
    assert torch.equal(outs[0], outs[1])
