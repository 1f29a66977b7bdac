"""linattn.exactness: every form of every operator against its fp64 reference (the demo's part 1)."""
from linattn.exactness import format_exactness, run_exactness


def test_every_form_matches_its_reference_at_a_tiny_size():
    rows = run_exactness(T=11, B=1, H=1, K=3, V=2, chunk_size=4)
    measured = [r for r in rows if r["max_rel_err"] is not None]
    assert not [r for r in rows if r["note"]], "a form failed to run"
    assert {r["name"] for r in measured if r["family"] == "linear_attention"} >= {"elu+1", "favor+", "cosformer"}
    assert {r["mode"] for r in measured} == {"parallel", "chunk", "recurrent"}
    assert max(r["max_rel_err"] for r in measured) < 1e-8
    assert "max rel err" in format_exactness(rows)
