"""`linattn bench infer` at the tiny shape (no timing assertions), its floor definition, llama.cpp's row through a
stand-in llama-bench."""
import importlib.util
import json
import os
import stat
import sys

import pytest
import torch

from linattn.bench import infer
from linattn.cli import main
from linattn.cpu import available as cpu_available, bindings
from linattn.models import LanguageModel, LMConfig

HAS_HF = importlib.util.find_spec("transformers") is not None


def test_decode_bytes_counts_one_embedding_row_and_a_tied_head_once():
    tied = LanguageModel(LMConfig(vocab_size=100, d_model=16, n_layers=1, n_heads=2, mixer="gated-deltanet"))
    untied = LanguageModel(LMConfig(vocab_size=100, d_model=16, n_layers=1, n_heads=2, mixer="gated-deltanet",
                                    tie_embeddings=False))
    every = sum(p.numel() * 4 for p in tied.parameters()) + sum(b.numel() * b.element_size() for b in tied.buffers())
    assert infer.model_decode_bytes(tied) == every                        # the table is the head: read whole, once
    every_u = (sum(p.numel() * 4 for p in untied.parameters())
               + sum(b.numel() * b.element_size() for b in untied.buffers()))
    assert infer.model_decode_bytes(untied) == every_u - 99 * 16 * 4     # one row of the input table
    assert infer.model_decode_bytes(untied.to(torch.bfloat16)) * 2 == infer.model_decode_bytes(untied.float()) - sum(
        b.numel() * b.element_size() for b in untied.buffers() if not b.is_floating_point())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_traffic_counts_states_twice_and_kv_rows_per_context(dtype):
    """The tiny shape's cache, counted from the shape: every Gated DeltaNet layer's fp32 state [H, K, K] and its q / k
    / v conv windows (3 channels of H K, conv size 4 - 1 columns) read and written; the softmax layer's K and V rows
    (KV heads x head dim, the model's dtype) read over the context, one written."""
    s = infer.SHAPES["tiny"]
    run = infer.Runner(infer.linattn_model(s, dtype, 0))
    run.prefill(torch.zeros(1, 7, dtype=torch.int64))
    run.decode(2)
    got = infer.state_traffic(run.cache)
    gdn = s["layers"] - s["layers"] // s["every"]
    conv = 3 * s["lin_heads"] * s["lin_dim"] * 3 * 4   # (the windows are fp32 in either dtype)
    assert got["state"] == 2 * gdn * (s["lin_heads"] * s["lin_dim"] ** 2 * 4 + conv)
    row = (s["layers"] // s["every"]) * 2 * s["kv_heads"] * s["attn_dim"] * torch.tensor([], dtype=dtype).element_size()
    assert got["kv_row"] == row and got["kv_tokens"] == 9
    assert infer.state_bytes(got, 10.5) == got["state"] + 11.5 * row
    assert infer.state_traffic(object()) is None and infer.state_bytes(None, 3) is None


def test_read_bandwidth_is_positive_and_sized_from_the_cache(monkeypatch):
    monkeypatch.setattr(infer, "last_level_cache_bytes", lambda: 1 << 20)
    bw = infer.ReadBandwidth()
    assert bw.nbytes == infer.MIN_BANDWIDTH_BYTES and bw.once() > 0
    assert infer.ReadBandwidth(8 << 20).nbytes == 8 << 20


def test_read_bandwidth_buffer_is_on_huge_page_mappings(monkeypatch):
    """The floor's buffer asks for 2 MiB pages (the machine's best read), and says so; LINATTN_HUGEPAGES=0: not."""
    from linattn.cpu import hugepages

    bw = infer.ReadBandwidth(8 << 20)
    if hugepages.unavailable() is None:
        assert hugepages._ours(bw.buf.data_ptr()) and bw.pages["unavailable"] is None
        assert "on 2 MiB pages" in bw.describe_pages()
    monkeypatch.setenv("LINATTN_HUGEPAGES", "0")
    off = infer.ReadBandwidth(8 << 20)
    assert not hugepages._ours(off.buf.data_ptr()) and off.pages["unavailable"] == "LINATTN_HUGEPAGES=0"
    assert off._read() == off.nbytes // 4


@pytest.mark.skipif(not cpu_available(), reason="needs the compiled CPU kernels")
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("n", [0, 5, 16384, 16384 * 3 + 17, 100_003])
def test_compiled_read_pass_reads_every_element(n, threads):
    """The bandwidth pass is a real read: its sum is the buffer's (fp64 reference), whole blocks, tail and all, at
    any thread count."""
    x = torch.rand(n, dtype=torch.float32, generator=torch.Generator().manual_seed(n)) - 0.25
    x[n // 2:n // 2 + 1] = 1000.0   # one large element anywhere must count
    out = torch.full((1,), float("nan"), dtype=torch.float64)
    bindings.bind("probe")("linattn_probe_read_sum", None, n, x.data_ptr(), threads, out.data_ptr())
    got, ref = float(out), float(x.double().sum())
    assert abs(got - ref) <= 1e-5 * (float(x.double().abs().sum()) + 1)


def test_read_bandwidth_uses_the_compiled_pass_or_says_it_does_not(monkeypatch):
    bw = infer.ReadBandwidth(4 << 20, passes=2)
    assert bw.method == ("compiled" if cpu_available() else "torch sum")
    assert bw._read() == bw.nbytes // 4   # a buffer of ones: the pass read every float
    monkeypatch.setattr(bindings, "bind", lambda name: None)
    off = infer.ReadBandwidth(4 << 20)
    assert off.method == "torch sum" and off._read() == off.nbytes // 4 and off.once() > 0


def test_parse_llama_bench():
    text = json.dumps([{"n_prompt": 16, "n_gen": 0, "avg_ts": 120.5}, {"n_prompt": 0, "n_gen": 4, "avg_ts": 9.25}])
    assert infer.parse_llama_bench(text) == {"prompt_tok_s": 120.5, "decode_tok_s": 9.25}


def _fake_llama_bench(tmp_path):
    """A stand-in llama-bench printing its own arguments' sizes as JSON records."""
    path = tmp_path / "llama-bench"
    path.write_text(f"#!{sys.executable}\nimport json, sys\na = sys.argv\n"
                    "p, n = int(a[a.index('-p') + 1]), int(a[a.index('-n') + 1])\n"
                    "print(json.dumps([{'n_prompt': p, 'n_gen': 0, 'avg_ts': 100.0},"
                    " {'n_prompt': 0, 'n_gen': n, 'avg_ts': 10.0}]))\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


@pytest.mark.skipif(not HAS_HF, reason="needs transformers (the hf extra)")
def test_bench_infer_tiny(tmp_path, capsys):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    rc = main(["bench", "infer", "--shape", "tiny", "--prompt", "8", "--decode", "2", "--repeats", "1",
               "--threads", "1", "--bandwidth-mib", "16", "--llama-bench", str(_fake_llama_bench(tmp_path)),
               "--gguf", f"fp32={gguf}", "--out", str(tmp_path), "--quiet"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "decode/floor" in out and "LESS THAN 4x" in out
    data = json.loads((tmp_path / "infer.json").read_text())
    rows = {(r["engine"], r["dtype"]): r for r in data["records"]}
    assert set(rows) == {(e, d) for e in infer.ENGINES for d in ("fp32", "bf16")} | {("llama.cpp", "fp32")}
    assert rows[("linattn", "bf16")]["bytes"] < rows[("linattn", "fp32")]["bytes"]
    # the same shape in both libraries: the weights' bytes agree to the few per-layer vectors they lay out apart
    lin, hf = rows[("linattn", "fp32")]["bytes"], rows[("transformers", "fp32")]["bytes"]
    assert abs(lin - hf) / hf < 0.05
    for r in data["records"]:
        assert r["decode_tok_s"] > 0 and r["prompt_tok_s"] > 0 and r["over_floor"] > 0
    for r in data["records"]:   # the second floor: the same model's states and KV rows at the mean context
        lin = rows[("linattn", r["dtype"])]
        assert r["state_bytes"] == lin["state_bytes"] > 0 and r["floor_states_ms"] > r["floor_ms"]
        assert r["over_floor_states"] == pytest.approx(r["over_floor"] * r["floor_ms"] / r["floor_states_ms"])
    for r in data["records"]:   # paired: each round's decode over the floor at the pass taken right before it
        pr = r["paired_rounds"]
        assert len(pr) == 1 and pr[0]["bandwidth_gbs"] > 0
        # the decode's CPU time per token (a model row's: this process's; llama.cpp's runs in its own)
        assert (pr[0]["decode_cpu_ms"] is None) == (r["engine"] == "llama.cpp")
        assert r["engine"] == "llama.cpp" or 0 < pr[0]["decode_cpu_ms"] < 2 * r["decode_ms"] * torch.get_num_threads()
        want = sorted(p["decode_ms"] * 1e-3 * p["bandwidth_gbs"] * 1e9 / r["bytes"] for p in pr)
        assert r["over_floor_paired"] == pytest.approx(want[len(want) // 2])
    assert "paired" in out
    assert "decode/floor+st" in out
    lr = rows[("llama.cpp", "fp32")]
    assert lr["decode_tok_s"] == 10.0
    for r in data["records"]:   # linattn's rows decode in one compiled call per round, the others token by token
        assert r["decode_path"] == {"linattn": "greedy", "llama.cpp": None}.get(r["engine"], "per-token")
    # its floor: the transformers model's bytes (the GGUF's weights) over the rounds' bandwidth, as every row's
    assert lr["bytes"] == rows[("transformers", "fp32")]["bytes"]
    assert lr["bandwidth_gbs"] == rows[("linattn", "fp32")]["bandwidth_gbs"] > 0
    for e in ("linattn", "kernelize"):   # placed when the plan was built (the tiny weights: all under 2 MiB, so
        wp = rows[(e, "fp32")]["weights_pages"]   # pieces of shared chunks, whole on huge pages, or left in place)
        assert set(wp["skipped"]) == {"smaller than min_bytes"} and wp["placed_bytes"] > 0
        assert wp["huge_capacity"] == wp["placed_bytes"]
    assert rows[("transformers", "fp32")]["weights_pages"] is None and lr["weights_pages"] is None
    pages = data["bandwidth_pages"]   # the floor's buffer: how much of it the kernel put on 2 MiB pages
    assert pages["bytes"] == 16 << 20 and (pages["huge_bytes"] is None or 0 <= pages["huge_bytes"] <= 18 << 20)
    assert lr["floor_ms"] == pytest.approx(lr["bytes"] / (lr["bandwidth_gbs"] * 1e9) * 1e3)
    assert lr["over_floor"] == pytest.approx(100.0 / lr["floor_ms"])


def test_llama_bench_runs_once_per_round_between_the_rows(tmp_path, monkeypatch):
    """One `llama-bench -r 1` per round and row, right after the round's model rows of its dtype."""
    events = []
    real_llama, real_decode = infer._llama_bench, infer.Runner.decode

    def llama(a, path, threads, log):
        events.append(("llama", os.path.basename(path), threads))
        return real_llama(a, path, threads, log)

    def decode(self, n):
        assert n == 3   # (the warm-up's and the rounds' decodes: the round's work)
        events.append(("model", self.model.embed.weight.dtype))
        return real_decode(self, n)

    monkeypatch.setattr(infer, "_llama_bench", llama)
    monkeypatch.setattr(infer.Runner, "decode", decode)
    fake = _fake_llama_bench(tmp_path)
    fake.write_text(fake.read_text().replace("a = sys.argv\n", "a = sys.argv\nassert a[a.index('-r') + 1] == '1', a\n"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    rc = main(["bench", "infer", "--shape", "tiny", "--engines", "linattn", "--prompt", "4", "--decode", "3",
               "--repeats", "2", "--threads", "1", "--bandwidth-mib", "16", "--llama-bench", str(fake),
               "--gguf", f"fp32={gguf}", "--out", str(tmp_path / "out"), "--quiet"])
    assert rc == 0
    one_round = [("model", torch.float32), ("llama", "m.gguf", 1), ("model", torch.bfloat16)]
    warm = [("model", torch.float32), ("model", torch.bfloat16)]   # (llama-bench warms itself up)
    assert events == warm + one_round * 2
    data = json.loads((tmp_path / "out" / "infer.json").read_text())
    assert [(r["engine"], r["dtype"]) for r in data["records"]] == [("linattn", "fp32"), ("llama.cpp", "fp32"),
                                                                    ("linattn", "bf16")]


@pytest.mark.skipif(not HAS_HF, reason="needs transformers (the hf extra)")
def test_bench_infer_quantized_llama_rows_pass_llama_args(tmp_path):
    """--gguf int8= / int4= rows (Q8_0 / Q4_0 files), with --llama-args reaching llama-bench's command line."""
    fake = _fake_llama_bench(tmp_path)
    fake.write_text(fake.read_text().replace("a = sys.argv\n", "a = sys.argv\nassert a[-2:] == ['--repack', '0'], a\n"))
    files = {d: tmp_path / f"{d}.gguf" for d in ("int8", "int4")}
    for f in files.values():
        f.write_bytes(b"GGUF")
    rc = main(["bench", "infer", "--shape", "tiny", "--engines", "linattn", "--dtypes", "int8,int4", "--prompt", "4",
               "--decode", "1", "--repeats", "1", "--threads", "1", "--bandwidth-mib", "16", "--llama-bench",
               str(fake), "--llama-args", "--repack 0", "--gguf", *(f"{d}={f}" for d, f in files.items()),
               "--out", str(tmp_path / "out"), "--quiet"])
    assert rc == 0
    data = json.loads((tmp_path / "out" / "infer.json").read_text())
    rows = {(r["engine"], r["dtype"]): r for r in data["records"]}
    assert rows[("llama.cpp", "int8")]["decode_tok_s"] == rows[("llama.cpp", "int4")]["decode_tok_s"] == 10.0


def test_bench_infer_bad_options_exit_2(tmp_path, capsys):
    assert main(["bench", "infer", "--engines", "nope"]) == 2
    assert main(["bench", "infer", "--dtypes", "fp16"]) == 2
    assert main(["bench", "infer", "--llama-bench", str(tmp_path / "missing")]) == 2
    fake = tmp_path / "lb"
    fake.write_text("")
    assert main(["bench", "infer", "--engines", "linattn", "--llama-bench", str(fake)]) == 2   # no --gguf
    err = capsys.readouterr().err
    assert "--engines" in err and "--dtypes" in err and "--llama-bench" in err
    assert os.listdir(tmp_path) == ["lb"]   # nothing written


def _fake_llama_cpp(tmp_path):
    """A stand-in llama.cpp source tree: its convert_hf_to_gguf.py checks what the real one needs (a saved model
    with a tokenizer, the pre-tokenizer named, the arguments) and writes a file."""
    root = tmp_path / "llama.cpp"
    (root / "conversion").mkdir(parents=True)
    (root / "gguf-py").mkdir()
    (root / "conversion" / "__init__.py").write_text("")
    (root / "conversion" / "base.py").write_text("class TextModel:\n    pass\n")
    (root / "convert_hf_to_gguf.py").write_text(
        "import os, sys\nfrom conversion import base\n"
        "a = sys.argv\nfolder = a[1]\n"
        "assert base.TextModel.get_vocab_base_pre(None, None) == 'qwen2'\n"
        "for f in ('config.json', 'tokenizer.json', 'tokenizer_config.json'):\n"
        "    assert os.path.isfile(os.path.join(folder, f)), f\n"
        "assert '--no-mtp' in a and a[a.index('--outtype') + 1] in ('f32', 'bf16')\n"
        "open(a[a.index('--outfile') + 1], 'w').write(a[a.index('--outtype') + 1])\n")
    return root


@pytest.mark.skipif(not HAS_HF, reason="needs transformers (the hf extra)")
def test_bench_infer_converts_with_a_llama_cpp_tree(tmp_path, capsys):
    rc = main(["bench", "infer", "--shape", "tiny", "--engines", "linattn", "--prompt", "4", "--decode", "1",
               "--repeats", "1", "--threads", "1", "2", "--bandwidth-mib", "16",
               "--llama-bench", str(_fake_llama_bench(tmp_path)), "--llama-cpp", str(_fake_llama_cpp(tmp_path)),
               "--out", str(tmp_path / "out"), "--quiet"])
    assert rc == 0
    data = json.loads((tmp_path / "out" / "infer.json").read_text())
    rows = {(r["engine"], r["dtype"], r["threads"]) for r in data["records"]}
    assert {("llama.cpp", d, t) for d in ("fp32", "bf16") for t in (1, 2)} <= rows


@pytest.mark.skipif(not HAS_HF, reason="needs transformers (the hf extra)")
def test_bench_infer_names_a_failed_conversion(tmp_path):
    root = _fake_llama_cpp(tmp_path)
    (root / "convert_hf_to_gguf.py").write_text("import sys\nprint('no such architecture', file=sys.stderr)\n"
                                                "sys.exit(3)\n")
    with pytest.raises(RuntimeError, match="(?s)convert_hf_to_gguf.py failed.*no such architecture"):
        main(["bench", "infer", "--shape", "tiny", "--engines", "linattn", "--dtypes", "fp32", "--prompt", "4",
              "--decode", "1", "--repeats", "1", "--threads", "1", "--bandwidth-mib", "16",
              "--llama-bench", str(_fake_llama_bench(tmp_path)), "--llama-cpp", str(root),
              "--out", str(tmp_path / "out"), "--quiet"])


def test_build_model_int8_activation_rows():
    """"int8-a8" / "int4-a8": the fp32 model quantized with activations="int8"; the same bytes as without."""
    from linattn.quant import quantization_summary

    s = infer.SHAPES["tiny"]
    for mode in ("int8", "int4"):
        a8, plain = infer.build_model("linattn", s, f"{mode}-a8", 0), infer.build_model("linattn", s, mode, 0)
        assert quantization_summary(a8)["activations"] == "int8" and quantization_summary(a8)["mode"] == mode
        assert quantization_summary(plain)["activations"] == "float"
        assert infer.model_decode_bytes(a8) == infer.model_decode_bytes(plain)


def test_pages_notes_name_rows_whose_weights_missed_huge_pages():
    """A row whose placed weights sit mostly on 4 KiB pages where 2 MiB pages could cover them gets one note (once
    over its thread counts); rows whose 2 MiB pages cover what they can (the storages' tails stay on 4 KiB pages),
    rows nothing placed and rows whose page count is unknown get none."""
    from linattn.bench.infer import PAGES_SHORT, pages_notes

    def rec(engine, dtype, threads, wp):
        return {"engine": engine, "dtype": dtype, "threads": threads, "weights_pages": wp}

    def wp(placed, huge, capacity):
        return {"placed_bytes": placed, "huge_bytes": huge, "huge_capacity": capacity, "skipped": {},
                "unavailable": None}

    short = wp(1_047_000_000, 174_000_000, 1_040_000_000)
    tails = wp(344_000_000, 262_144_000, 262_144_000)   # (int4: every storage's tail past its last 2 MiB boundary)
    edge = wp(100, int(PAGES_SHORT * 100), 100)
    records = [rec("kernelize", "bf16", 1, short), rec("kernelize", "bf16", 2, short), rec("linattn", "int4", 1, tails),
               rec("linattn", "fp32", 1, edge), rec("llama.cpp", "bf16", 1, None),
               rec("linattn", "int8", 1, dict(tails, huge_bytes=None)), rec("kernelize", "fp32", 1, wp(0, 0, 0))]
    notes = pages_notes(records)
    assert len(notes) == 1 and notes[0].startswith("note: kernelize bf16: 174 of the 1,040 MB")
    assert pages_notes([rec("linattn", "fp32", 1, dict(edge, huge_bytes=edge["huge_bytes"] - 1))])


def test_huge_capacity_counts_whole_2mib_pages_of_each_range():
    from linattn.cpu.hugepages import HUGE, PlacementReport

    rep = PlacementReport(ranges=[(0, 3 * HUGE + 5), (10 * HUGE + 64, HUGE - 1), (20 * HUGE + 4096, 2 * HUGE)])
    # (the second is under a huge page: a piece of a shared chunk, all of it on huge pages; the third starts past a
    # boundary: one whole page fits)
    assert rep.huge_capacity() == 3 * HUGE + (HUGE - 1) + HUGE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_runner_greedy_path_decodes_the_per_token_tokens(dtype, monkeypatch):
    """A linattn row's one compiled call (`model_greedy`) leaves the runner where the per-token loop leaves it: the
    same next token, tokens seen and last state."""
    from linattn.cpu import decode as cpu_decode
    from linattn.models import decode_plan

    if not cpu_decode.available():
        pytest.skip("no C compiler: the compiled kernels are off")
    s = infer.SHAPES["tiny"]
    ids = torch.randint(0, s["vocab"], (1, 6), generator=torch.Generator().manual_seed(4))
    runs = {}
    for path in ("greedy", "per-token"):
        if path == "per-token":
            monkeypatch.setattr(decode_plan, "model_greedy", lambda *a, **k: None)
        run = runs[path] = infer.Runner(infer.linattn_model(s, dtype, 0))
        run.prefill(ids)
        assert run.decode(5) > 0 and run.path == path
    a, b = runs["greedy"], runs["per-token"]
    assert torch.equal(a.tok, b.tok) and a.cache.seen_tokens == b.cache.seen_tokens == 11
    assert torch.equal(a.cache.layers[0]["mixer"].state, b.cache.layers[0]["mixer"].state)


def _plan_builders(engine):
    """(module, name) of the function that builds `engine`'s compiled whole-model decode plan."""
    if engine == "linattn":
        from linattn.models import decode_plan

        return decode_plan, "_build_model_plan"
    from linattn.hf import kernelize_plan

    return kernelize_plan, "_build"


@pytest.mark.skipif(not cpu_available(), reason="needs the compiled CPU kernels")
@pytest.mark.parametrize("engine", ["linattn", pytest.param("kernelize", marks=pytest.mark.skipif(
    not HAS_HF, reason="needs transformers (the hf extra)"))])
def test_warm_up_runs_each_rounds_work_at_its_thread_count(engine, tmp_path, monkeypatch):
    """Before the first timed round at a thread count, every model row has run that round's exact work at that
    count (a prefill of --prompt tokens, then --decode tokens), and no compiled decode plan is built once rounds are
    timed: a plan is built per thread count, and a warm-up at torch's default count before `--threads 1` left each
    row's first timed decode a plan build (2.5-3.4x the later rounds at the 530M shape, Round 18b). Torch starts at
    3 threads here, neither of the rounds' counts. (Quantized rows: a float model's plan is rebuilt by design
    after every prefill, whose new cache clears its fused weights, `LanguageModel.new_cache`: in every round alike.)"""
    events = []
    mod, name = _plan_builders(engine)
    real_build, real_once = getattr(mod, name), infer.ReadBandwidth.once
    real_prefill, real_decode = infer.Runner.prefill, infer.Runner.decode

    def build(*args, **kw):
        events.append(("build", torch.get_num_threads()))
        return real_build(*args, **kw)

    def once(self):   # (a round's first call: the paired pass before each row's timed work)
        events.append(("pass", torch.get_num_threads()))
        return real_once(self)

    def prefill(self, ids):
        events.append(("prefill", id(self), ids.shape[1], torch.get_num_threads()))
        return real_prefill(self, ids)

    def decode(self, n):
        events.append(("decode", id(self), n, torch.get_num_threads()))
        return real_decode(self, n)

    monkeypatch.setattr(mod, name, build)
    monkeypatch.setattr(infer.ReadBandwidth, "once", once)
    monkeypatch.setattr(infer.Runner, "prefill", prefill)
    monkeypatch.setattr(infer.Runner, "decode", decode)
    torch.set_num_threads(3)   # (the autouse fixture puts the count back)
    rc = main(["bench", "infer", "--shape", "tiny", "--engines", engine, "--dtypes", "int8,int8-a8", "--prompt",
               "5", "--decode", "3", "--repeats", "2", "--threads", "1", "2", "--bandwidth-mib", "16", "--out",
               str(tmp_path), "--quiet"])
    assert rc == 0
    runners = list(dict.fromkeys(e[1] for e in events if e[0] == "prefill"))
    assert len(runners) == 2 and events.count(("build", 1)) == 2   # (each row's plan, in the first warm-up)
    for t in (1, 2):
        first = events.index(("pass", t))   # the first timed round at t starts here
        before = [e for e in events[:first] if e[0] in ("prefill", "decode") and e[3] == t]
        for r in runners:   # the round's work, in order, at t
            assert [e[:3] for e in before if e[1] == r] == [("prefill", r, 5), ("decode", r, 3)]
        # built (or, linattn's at a new thread count, re-pointed) in the warm-up, never in a timed round
        assert all(i < first for i, e in enumerate(events) if e == ("build", t)), events
        timed = [e for e in events if e[0] in ("prefill", "decode") and e[3] == t]
        assert len(timed) == 2 * 2 * (2 + 1)   # two rows, a prefill and a decode each, two rounds and the warm-up
    data = json.loads((tmp_path / "infer.json").read_text())
    assert all(r["decode_path"] == ("greedy" if engine == "linattn" else "per-token") for r in data["records"])
