"""The timing build of the compiled whole-model decode (LINATTN_DECODE_TIMING, cpu/decode.section_times): a plan built
while the variable is set runs decode.c compiled with the timing sections, which change no bit of the logits or
states; each section's bytes per token are the matrices it reads (counted from the model's shapes here), the call
count is the decoded tokens; a plan built without it runs the native library, which counts nothing; `bench infer
--profile` prints the per-section table."""
import json
import os

import pytest
import torch

from linattn.bench import infer
from linattn.cli import main
from linattn.cpu import decode as cpu_decode
from tests.helpers import CompiledDecodeCalls

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler: the compiled kernels are off")

SHAPE = infer.SHAPES["tiny"]


def _decode(dtype, n, monkeypatch, timing: bool):
    """The tiny hybrid (3 Gated DeltaNet : 1 softmax) decoding n tokens after a 5-token prompt: (logits, the last
    cache's first state)."""
    if timing:
        monkeypatch.setenv(cpu_decode.TIMING_SWITCH, "1")
    else:
        monkeypatch.delenv(cpu_decode.TIMING_SWITCH, raising=False)
    run = infer.Runner(infer.linattn_model(SHAPE, dtype, 0))
    ids = torch.randint(0, SHAPE["vocab"], (1, 5 + n), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = run.model(ids[:, :5], use_cache=True)
        cache, logits = out.cache, []
        cpu_decode.section_times(reset=True)
        for t in range(5, 5 + n):
            logits.append(run.model(ids[:, t:t + 1], cache=cache).logits)
    return torch.cat(logits, 1), cache.layers[0]["mixer"].state.clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_timing_build_same_bits_and_bytes_by_section(dtype, monkeypatch):
    calls = CompiledDecodeCalls(monkeypatch)
    want, want_state = _decode(dtype, 6, monkeypatch, timing=False)
    st0 = cpu_decode.section_times()   # (the native library counts nothing)
    assert st0 is None or st0["tokens"] == 0
    got, got_state = _decode(dtype, 6, monkeypatch, timing=True)
    assert calls.model == 12
    assert torch.equal(got, want) and torch.equal(got_state, want_state)
    st = cpu_decode.section_times()
    assert st["tokens"] == 6 and set(st["seconds"]) == set(cpu_decode.SECTIONS)
    s, e = SHAPE, torch.tensor([], dtype=dtype).element_size()
    gdn, att = s["layers"] - s["layers"] // s["every"], s["layers"] // s["every"]
    per = {k: v / st["tokens"] for k, v in st["bytes"].items()}
    hv_v = s["lin_heads"] * s["lin_dim"]
    assert per["embed"] == s["d"] * e and per["head"] == s["vocab"] * s["d"] * e   # (one row; the tied table once)
    assert per["gate_up"] == s["layers"] * 2 * s["inter"] * s["d"] * e
    assert per["down"] == s["layers"] * s["d"] * s["inter"] * e
    assert per["out"] == (gdn * hv_v + att * s["attn_heads"] * s["attn_dim"]) * s["d"] * e
    assert per["state"] == gdn * 2 * s["lin_heads"] * s["lin_dim"] ** 2 * 4   # (fp32 states, read and written)
    assert per["attn"] > 0 and per["qkv"] > 0
    assert all(v >= 0 for v in st["seconds"].values())
    assert sum(v for k, v in st["seconds"].items() if k != "total") <= st["seconds"]["total"] * 1.001 + 1e-6
    assert cpu_decode.section_times()["tokens"] == 0   # (reset by the read before)


def test_timing_switch_values(monkeypatch):
    for off in ("", "0", "false", "Off", "no"):
        monkeypatch.setenv(cpu_decode.TIMING_SWITCH, off)
        assert not cpu_decode.timing_requested()
    monkeypatch.setenv(cpu_decode.TIMING_SWITCH, "1")
    assert cpu_decode.timing_requested()
    monkeypatch.delenv(cpu_decode.TIMING_SWITCH)
    assert not cpu_decode.timing_requested()


def test_bench_infer_profile_prints_the_sections(tmp_path, capsys):
    assert main(["bench", "infer", "--shape", "tiny", "--engines", "linattn", "--dtypes", "fp32", "--threads", "1",
                 "--prompt", "4", "--decode", "3", "--repeats", "2", "--profile", "--out", str(tmp_path),
                 "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "linattn fp32, 1 thread(s): where a decoded token's time goes" in text
    for name in ("qkv", "state", "attn", "gate_up", "down", "head", "setup", "in call", "ctypes", "forward, python",
                 "loop", "outside call"):
        assert f"\n{name} " in text
    rec = json.loads((tmp_path / "infer.json").read_text())["records"][0]
    sec = rec["sections"]
    assert sec["decode"]["ms"] >= sec["in call"]["ms"] > 0 and sec["head"]["bytes"] == SHAPE["vocab"] * SHAPE["d"] * 4
    # (one round's numbers: the lines add up to its decode time, nothing unassigned)
    ms = {k: v["ms"] for k, v in sec.items()}
    assert ms["in call"] + ms["outside call"] == pytest.approx(ms["decode"], rel=1e-9)
    assert ms["ctypes"] + ms["forward, python"] + ms["loop"] == pytest.approx(ms["outside call"], rel=1e-9)
    inner = sum(v for k, v in ms.items() if k in cpu_decode.SECTIONS)
    assert inner <= ms["in call"] * 1.001 and inner >= ms["in call"] * 0.9
    assert min(ms["ctypes"], ms["forward, python"], ms["loop"], ms["setup"], ms["teardown"]) >= 0
    assert cpu_decode.TIMING_SWITCH not in os.environ   # (restored after the run)
