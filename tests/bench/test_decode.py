"""`linattn bench decode` end to end at tiny sizes (no timing assertions)."""
import json

from linattn.cli import main


def test_bench_decode_tiny(tmp_path, capsys):
    rc = main(["bench", "decode", "--N", "32", "64", "--mixers", "softmax,linear-elu+1,deltanet",
               "--d-model", "16", "--n-heads", "2", "--n-layers", "1", "--vocab-size", "40",
               "--decode-steps", "2", "--bandwidth-mib", "16", "--out", str(tmp_path), "--quiet"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "decode ms/token" in out
    data = json.loads((tmp_path / "decode.json").read_text())
    by = {(r["model"], r["N"]): r for r in data["records"]}
    # constant-size state for the linear mixers, a growing KV cache for softmax
    assert by[("linear-elu+1", 32)]["cache_bytes"] == by[("linear-elu+1", 64)]["cache_bytes"]
    assert by[("deltanet", 32)]["cache_bytes"] == by[("deltanet", 64)]["cache_bytes"]
    assert by[("softmax", 64)]["cache_bytes"] > by[("softmax", 32)]["cache_bytes"]
    assert (tmp_path / "decode.png").stat().st_size > 0
    # the floor is bench infer's: decode bytes over the bandwidth, the same bytes at every N
    from linattn.bench.infer import model_decode_bytes
    from linattn.models import LanguageModel, LMConfig
    model = LanguageModel(LMConfig(vocab_size=40, d_model=16, n_heads=2, n_layers=1, mixer="deltanet"))
    for N in (32, 64):
        r = by[("deltanet", N)]
        assert r["decode_bytes"] == model_decode_bytes(model)
        assert abs(r["floor_ms"] - r["decode_bytes"] / (r["bandwidth_gbs"] * 1e9) * 1e3) < 1e-9 * r["floor_ms"]
        assert abs(r["step_over_floor"] - r["hit"]["median_ms"] / r["floor_ms"]) < 1e-9 * r["step_over_floor"]


def test_bench_decode_unknown_mixer_exits_2(capsys):
    assert main(["bench", "decode", "--mixers", "nope", "--N", "8"]) == 2
    assert "unknown" in capsys.readouterr().err
