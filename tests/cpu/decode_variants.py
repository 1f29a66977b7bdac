"""The compiled decode library's other code paths as one pytest fixture for the quantized-product tests
(test_qmatvec.py, test_qmatvec_a8.py): decode.c built with a prefix that removes or defines a macro (tests/helpers.py
build_decode_variant), bound in place of the native library while a test module runs."""
from __future__ import annotations

import pytest

from linattn.cpu import bindings
from tests.helpers import build_decode_variant, cpu_flags


def decode_variant_fixture(paths: dict[str, tuple[str, set[str]]]):
    """A module-scoped fixture `decode_lib` over `paths` ({name: (prefix, the CPU flags the path needs)}), its value
    the path's name; an empty prefix is the native library as built, a path whose flags the machine lacks skips."""

    @pytest.fixture(scope="module", params=sorted(paths))
    def decode_lib(request, tmp_path_factory):
        prefix, needs = paths[request.param]
        if not needs <= cpu_flags():
            pytest.skip(f"the {request.param} path needs {sorted(needs)}")
        if not prefix:
            yield request.param
            return
        with pytest.MonkeyPatch.context() as mp:
            lib = build_decode_variant(tmp_path_factory.mktemp(request.param), prefix)   # cached by source hash
            mp.setattr(bindings, "load_library", lambda name: lib if name == "decode" else None)
            yield request.param

    return decode_lib
