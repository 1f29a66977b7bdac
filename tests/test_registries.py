"""The registries themselves: the mixer listing stays what it was when the registrations moved into the layer
modules (order, names, classes, defaults, descriptions), and registering / unregistering behaves."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from linattn.models.registry import mixer_spec, mixers

LISTING = Path(__file__).parent / "data" / "registry" / "mixers.json"


def mixer_listing():
    """Every registered mixer as plain data (defaults by repr, so a float 1.0 and an int 1 differ)."""
    out = []
    for name in mixers():
        s = mixer_spec(name)
        out.append({"name": name, "cls": f"{s.cls.__module__}.{s.cls.__qualname__}",
                    "defaults": {k: repr(v) for k, v in s.defaults.items()}, "description": s.description,
                    "rope": s.rope_default, "short_conv": s.short_conv_default})
    return out


def test_mixer_listing_is_unchanged():
    """tests/data/registry/mixers.json was written from the registry before the registrations moved out of
    models/registry.py; a deliberate change (a new mixer) updates that file in the same commit."""
    expected = json.loads(LISTING.read_text(encoding="utf-8"))
    got = mixer_listing()
    assert [m["name"] for m in got] == [m["name"] for m in expected]
    for g, e in zip(got, expected):
        assert g == e, g["name"]


@pytest.mark.parametrize("name", ["softmax", "linear-elu+1", "mamba2", "rwkv7"])
def test_mixer_spec_names_its_class(name):
    assert mixer_spec(name).cls.__name__ in {"SoftmaxAttention", "LinearAttention", "Mamba2Block", "RWKV7"}
