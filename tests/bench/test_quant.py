"""`linattn bench quant` end to end at tiny sizes (no timing assertions), and the bytes a decoded token reads."""
import json

import torch

import linattn
from linattn import LanguageModel, LMConfig
from linattn.bench.quant import decode_bytes
from linattn.cli import main
from linattn.cpu import decode as cpu_decode
from linattn.quant import quantized_modules


def _model(tie):
    return LanguageModel(LMConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, mixer="gated-deltanet",
                                  tie_embeddings=tie))


def test_decode_bytes_reads_each_weight_once_and_one_embedding_row():
    for tie in (False, True):
        m = _model(tie)
        every = sum(p.numel() * 4 for p in m.parameters())          # parameters() lists a tied matrix once
        table = 64 * 32 * 4
        row = 32 * 4
        assert decode_bytes(m) == (every if tie else every - table + row)
        fp32 = decode_bytes(m)
        assert decode_bytes(m.to(torch.bfloat16)) == fp32 // 2
    q = linattn.quantize(_model(True), "int8")
    qbytes = sum(x.numel() * x.element_size() for n, x in q.state_dict().items()
                 if n.rsplit(".", 1)[0] in quantized_modules(q))
    float_rest = sum(p.numel() * 4 for n, p in q.named_parameters() if n != "embed.weight")
    assert decode_bytes(q) == qbytes + float_rest + row


def test_bench_quant_tiny(tmp_path, capsys):
    rc = main(["bench", "quant", "--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--ffn-hidden", "64",
               "--vocab-size", "64", "--prompt", "8", "--tokens", "2", "--repeats", "1", "--bandwidth-mib", "8",
               "--kernels", "--out", str(tmp_path), "--quiet"])
    assert rc == 0
    assert "x floor" in capsys.readouterr().out
    result = json.loads((tmp_path / "quant.json").read_text())
    # (+ the fp32 prefill path's four, the dequantization alone four ways, + the compiled decode's int8 / int4
    # products, fp32 and int8 x)
    ways = 17 + 4 * cpu_decode.available()
    assert len(result["kernels"]) == ways * 4 and all(r["ms"] > 0 for r in result["kernels"])
    rows = result["speed"]
    assert [r["precision"] for r in rows] == ["fp32", "bf16", "int8", "int4"]
    for r in rows:
        assert r["decode_tok_s"] > 0 and abs(r["over_floor"] - r["decode_ms"] / r["floor_ms"]) < 1e-9 * r["over_floor"]
    assert rows[2]["bytes_per_token"] < rows[1]["bytes_per_token"] < rows[0]["bytes_per_token"]


def test_bench_quant_int8_activation_rows(tmp_path):
    rc = main(["bench", "quant", "--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--ffn-hidden", "64",
               "--vocab-size", "64", "--prompt", "8", "--tokens", "2", "--repeats", "1", "--bandwidth-mib", "8",
               "--precisions", "int4,int4-a8,int8-a8", "--compute", "fp32", "--out", str(tmp_path), "--quiet"])
    assert rc == 0
    rows = json.loads((tmp_path / "quant.json").read_text())["speed"]
    assert [r["precision"] for r in rows] == ["int4", "int4-a8", "int8-a8"]
    assert rows[0]["bytes_per_token"] == rows[1]["bytes_per_token"] < rows[2]["bytes_per_token"]


def test_bench_quant_kernel_rows_and_ways(tmp_path):
    rc = main(["bench", "quant", "--d-model", "32", "--ffn-hidden", "64", "--repeats", "1", "--no-speed", "--kernels",
               "--kernel-rows", "3,97", "--kernel-ways", "blocks,bf16 x", "--out", str(tmp_path),
               "--quiet"])
    assert rc == 0
    kernels = json.loads((tmp_path / "quant.json").read_text())["kernels"]
    ways = ["int8 packed, bf16 x", "int4 packed, bf16 x", "int8 dequant (bf16-rounded) + fp32 matmul, blocks",
            "int8 dequant (exact) + fp32 matmul, blocks", "int4 dequant (bf16-rounded) + fp32 matmul, blocks",
            "int4 dequant (exact) + fp32 matmul, blocks"]
    assert [(r["rows"], r["way"]) for r in kernels] == [(M, w) for M in (3, 97) for w in ways]


def test_bench_quant_dequant_ways_on_the_thread_clock(tmp_path, capsys):
    rc = main(["bench", "quant", "--d-model", "32", "--ffn-hidden", "64", "--repeats", "1", "--no-speed", "--kernels",
               "--kernel-rows", "5", "--kernel-ways", "dequant only", "--kernel-clock", "thread", "--out",
               str(tmp_path), "--quiet"])
    assert rc == 0
    assert "thread CPU time" in capsys.readouterr().out
    kernels = json.loads((tmp_path / "quant.json").read_text())["kernels"]
    assert [r["way"] for r in kernels] == [f"int{b} dequant only, {how}" for b in (8, 4)
                                           for how in ("compiled", "torch ops")]
    assert all(r["clock"] == "thread" and r["ms"] >= 0 for r in kernels)


def test_bench_quant_bad_options_exit_2(capsys):
    assert main(["bench", "quant", "--precisions", "fp8"]) == 2
    assert "--precisions" in capsys.readouterr().err
    for bad in ("", "0,16", "x"):
        assert main(["bench", "quant", "--kernels", "--kernel-rows", bad]) == 2
        assert "--kernel-rows" in capsys.readouterr().err
    assert main(["bench", "quant", "--checkpoint", "x"]) == 2
    assert "go together" in capsys.readouterr().err
