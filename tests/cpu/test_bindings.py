"""Every ctypes binding against the C prototypes it calls: the exported functions of each csrc/*.c are parsed from
the source (the self-included REAL / FN() form of every file), and each one's argument count and types and its
return type must equal the binding's (abi.LIBRARIES). The plan structs are checked field by field against the C
typedefs and by size against the library's exported `linattn_sizeof_<plan>()`; the feature-map codes of common.h
against linattn/feature_codes.py. A binding that drifts from its C function fails here instead of passing garbage
through ctypes."""
from __future__ import annotations

import ctypes
import re
from typing import Dict, List, Tuple

import pytest

from linattn import feature_codes
from linattn.cpu import abi, bindings, build as cbuild, decode as cpu_decode

CSRC = cbuild.CSRC
SCALAR = {"int64_t": ctypes.c_int64, "int": ctypes.c_int, "int32_t": ctypes.c_int32, "double": ctypes.c_double,
          "float": ctypes.c_float, "void": None}
STRUCTS = {"linattn_linear_plan": abi.LinearPlan, "linattn_delta_plan": abi.DeltaPlan,
           "linattn_linear_log_plan": abi.LinearLogPlan,
           "linattn_block_plan": abi.BlockPlan, "linattn_model_plan": abi.ModelPlan}


def _source(name: str) -> str:
    text = (CSRC / f"{name}.c").read_text()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)  # comments out
    return text.replace("\\\n", "\n")  # macro bodies as plain lines


def _ctype(decl: str):
    """A C parameter or return declaration (without its name) -> the ctypes type a binding must use."""
    decl = re.sub(r"\b(const|restrict)\b", " ", decl).strip()
    if "*" in decl:
        base = decl.replace("*", " ").split()[0]
        return ctypes.POINTER(STRUCTS[base]) if base in STRUCTS else ctypes.c_void_p
    return SCALAR[decl.split()[0]]


def _param_type(param: str):
    param = param.strip()
    name = re.search(r"(\w+)\s*$", param).group(1)
    return _ctype(param[: param.rindex(name)])


def prototypes(name: str) -> Dict[str, Tuple[object, List[object]]]:
    """{exported C name: (return ctypes type, [argument ctypes types])} of csrc/<name>.c, both variants of a typed
    function (FN(x) or x_##SFX -> x_f32 and x_f64)."""
    text = _source(name)
    out = {}
    pat = re.compile(r"^(int|void|int64_t)\s+(?:FN\((linattn_\w+)\)|(linattn_\w+?)(_##SFX)?)\s*\(([^)]*)\)\s*\{",
                     re.M | re.S)
    for m in pat.finditer(text):
        ret, fn_name, plain, sfx, params = m.groups()
        params = " ".join(params.split())
        args = [] if params in ("", "void") else [_param_type(p) for p in params.split(",")]
        if fn_name or sfx:
            for suffix in ("f32", "f64"):
                out[f"{fn_name or plain}_{suffix}"] = (SCALAR[ret], args)
        else:
            out[plain] = (SCALAR[ret], args)
    return out


def struct_fields(typedef: str) -> List[Tuple[str, object]]:
    """[(field, ctypes type)] of `typedef struct { ... } <typedef>;` in the sources."""
    for path in sorted(CSRC.glob("*.c")):
        text = re.sub(r"/\*.*?\*/", " ", path.read_text(), flags=re.S)
        m = re.search(r"typedef struct \{([^{}]*)\}\s*" + typedef + r"\s*;", text, re.S)
        if m:
            break
    else:
        raise AssertionError(f"no typedef {typedef}")
    sizes = {k: int(v) for k, v in re.findall(r"^#define (\w+) (\d+)\s*$", text, re.M)}
    fields = []
    for decl in m.group(1).split(";"):
        decl = " ".join(decl.split())
        if not decl:
            continue
        base = re.match(r"((?:const\s+)?\w+)", decl).group(1)
        for item in decl[len(base):].split(","):
            item = item.strip()
            fname, count = re.search(r"(\w+)\s*(?:\[(\w+)\])?$", item).groups()   # (an array: [N] or [NAME])
            t = ctypes.c_void_p if "*" in item else SCALAR[base.replace("const", "").strip()]
            fields.append((fname, t if count is None else t * (int(count) if count.isdigit() else sizes[count])))
    return fields


def _bound_types(name: str) -> Dict[str, Tuple[object, List[object]]]:
    """What the Python side declares for library `name`: its table's entries."""
    out = {}
    for fn in abi.LIBRARIES[name].functions:
        for sym in ([f"{fn.name}_f32", f"{fn.name}_f64"] if fn.typed else [fn.name]):
            out[sym] = (fn.restype, list(fn.args))
    return out


def _same(a, b) -> bool:
    if a is b or a == b:
        return True
    if hasattr(a, "_type_") and hasattr(b, "_type_") and not isinstance(a._type_, str):  # two POINTER(struct)s
        return a._type_ is b._type_
    return False


@pytest.mark.parametrize("name", sorted(abi.LIBRARIES))
def test_every_binding_matches_its_c_prototype(name):
    if cbuild.load_library(name) is None:
        pytest.skip("no C compiler: the compiled kernels are off")
    protos = prototypes(name)
    bound = _bound_types(name)
    exported = {s for s in protos if not s.endswith("_abi_version")}
    if name == "decode":   # the timing build's export, bound by cpu/decode.py (the native library has none)
        timing, restype, argtypes = cpu_decode.TIMING_FUNCTION
        bound[timing] = (restype, list(argtypes))
    assert set(bound) == exported, "functions exported but not bound, or bound but not in the source"
    for sym, (ret, args) in bound.items():
        c_ret, c_args = protos[sym]
        assert len(args) == len(c_args), f"{sym}: {len(args)} arguments bound, {len(c_args)} in C"
        for i, (a, c) in enumerate(zip(args, c_args)):
            assert _same(a, c), f"{sym}: argument {i} bound as {a}, C says {c}"
        assert _same(ret, c_ret), f"{sym}: returns {c_ret} in C, bound as {ret}"


@pytest.mark.parametrize("typedef", sorted(STRUCTS))
def test_plan_structs_match_the_c_typedefs(typedef):
    struct = STRUCTS[typedef]
    want = struct_fields(typedef)
    got = [(f, t) for f, t in struct._fields_]
    assert [f for f, _ in got] == [f for f, _ in want]
    for (f, t), (_, c) in zip(got, want):
        assert t == c, (typedef, f, t, c)


@pytest.mark.parametrize("name", sorted(n for n, lib in abi.LIBRARIES.items() if lib.structs))
def test_struct_sizes_and_abi_versions_from_the_libraries(name):
    lib = cbuild.load_library(name)
    if lib is None:
        pytest.skip("no C compiler: the compiled kernels are off")
    for sname, struct in abi.LIBRARIES[name].structs.items():
        size = getattr(lib, f"linattn_sizeof_{sname}")
        size.restype = ctypes.c_int64
        assert size() == ctypes.sizeof(struct)
    assert cbuild.interface_problem(name, lib) is None


def test_every_library_exports_its_abi_version_and_the_loader_checks_it(tmp_path, monkeypatch):
    """A library that answers another ABI version is refused (one notice, then the PyTorch path)."""
    for name in abi.LIBRARIES:
        assert re.search(r"LA_ABI_VERSION\(" + name + r", (\d+)\)|linattn_" + name + r"_abi_version\(void\) \{ return "
                         r"(\d+); \}", _source(name)), name
        m = re.search(r"LA_ABI_VERSION\(" + name + r", (\d+)\)", _source(name))
        if m:
            assert int(m.group(1)) == abi.LIBRARIES[name].abi, name
    src = tmp_path / "src"
    src.mkdir()
    for f in CSRC.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    # probe.c: the loader's check is the same for every library, and probe compiles fastest
    text = (src / "probe.c").read_text()
    (src / "probe.c").write_text(text.replace(f"LA_ABI_VERSION(probe, {abi.LIBRARIES['probe'].abi})",
                                              "LA_ABI_VERSION(probe, 999)"))
    monkeypatch.setenv("LINATTN_CACHE_DIR", str(tmp_path / "cache"))
    lib = ctypes.CDLL(str(cbuild.build("probe", src)))
    assert "ABI version is 999" in cbuild.interface_problem("probe", lib)
    with pytest.warns(UserWarning, match="ABI version is 999"):
        assert cbuild.load_library("probe", src) is None


def test_every_source_is_in_the_house_style():
    """One template form (no backslash-continued DEFINE_* bodies), common.h's fp-contract decision (no pragma),
    exp, SiLU and rows (no copy of its own), and decode's plan structs declared once (abi.py)."""
    for path in sorted(CSRC.glob("*.c")):
        text = re.sub(r"/\*.*?\*/", " ", path.read_text(), flags=re.S)
        assert not re.search(r"^#define DEFINE_\w+\(", text, re.M), path.name
        assert not re.search(r"\b(vexp_f(32|64)|silu_f(32|64))\b", text), path.name
        on_common = '#include "common.h"' in text and not re.search(r"fp-contract|fp contract|FP_CONTRACT", text)
        assert on_common, path.name
    assert cpu_decode.BlockPlan is abi.BlockPlan and cpu_decode.ModelPlan is abi.ModelPlan


def test_the_binding_maps_return_codes_and_picks_the_dtype_variant():
    import torch

    lib = bindings.bind("probe")
    if lib is None:
        pytest.skip("no C compiler: the compiled kernels are off")
    for dtype in (torch.float32, torch.float64):
        x = torch.tensor([0.0, 1.0], dtype=dtype)
        y = torch.empty_like(x)
        lib("linattn_probe_exp", dtype, 2, x.data_ptr(), y.data_ptr())
        assert y[0] == 1 and abs(float(y[1]) - 2.718281828459045) < 1e-6
    with pytest.raises(TypeError, match="float32 or float64"):
        lib("linattn_probe_exp", torch.bfloat16, 0, None, None)
    assert lib("linattn_probe_threads", None, 1) == 1  # a count, not a status code

    class FakeLibrary:  # every function fails: the status codes become exceptions
        def __getattr__(self, symbol):
            def f(*args):
                return 1
            setattr(self, symbol, f)
            return f

    fake = bindings.Bound("gatednorm", FakeLibrary())
    with pytest.raises(MemoryError, match="linattn_gnorm_bwd .gatednorm. could not allocate"):
        fake("linattn_gnorm_bwd", torch.float64, *([0] * 11))


def test_feature_map_codes_are_one_table():
    text = (CSRC / "common.h").read_text()
    codes = {m.group(1): int(m.group(2)) for m in re.finditer(r"#define LA_FMAP_(\w+) (\d+)", text)}
    assert codes == {"IDENTITY": feature_codes.FMAP_IDENTITY, "ELU1": feature_codes.FMAP_ELU1,
                     "RELU": feature_codes.FMAP_RELU}
    from linattn.cpu import linear

    assert cpu_decode.FEATURE_MAPS is feature_codes.FUSED_MAPS
    assert {k: v for k, v in linear.FMAPS.items() if k is not None} == feature_codes.FUSED_MAPS
