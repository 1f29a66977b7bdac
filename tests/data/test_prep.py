"""Data preparation that scales (issue 19, points 1-3): bounded reads under the byte cap, the
tokenizer trained and the text encoded in bounded segments, a memory-mapped token cache in the run
folder, progress per phase, bounded pre-tokenizer pieces for long lines, interrupts, and files that
are not regular UTF-8 text. Small generated data only (tmp_path); no timing assertions."""
import json
import os
import random
import signal
import stat
import sys
import threading

import numpy as np
import pytest
import torch

from linattn.data import prep as prep_mod, sources, tokenizer as tok_mod
from linattn.data.corpus import (
    CorpusError,
    PackedTokens,
    load_corpus,
    read_documents,
    split_documents,
    token_fingerprint,
    tokenize_documents,
)
from linattn.data.prep import prepare_tokens
from linattn.data.tokenizer import MAX_PIECE_CHARS, train_tokenizer
from linattn.models import LMConfig
from linattn.training import TrainConfig, prepare_data, train

WORDS = ["alpha", "beta", "gamma", "delta", "def", "return", "class", "lambda", "yield", "import", "self",
         "None", "print", "value", "x", "(", ")", ":", "=", "+", "1", "2", "42", "héllo", "✓", "'s", "don't"]
SPACES = [" ", " ", " ", " ", "  ", "\n", "\n", "\t", "\n\n", " \n", "\r\n", "    "]


pytestmark = pytest.mark.usefixtures("one_thread")


def words_text(n_words: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    out = []
    for _ in range(n_words):
        out.append(rng.choice(WORDS))
        out.append(rng.choice(SPACES))
    return "".join(out)


def write_corpus(folder, n_files=6, n_words=1500):
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n_files):
        (folder / f"doc{i:02d}.txt").write_text(words_text(n_words, seed=i), encoding="utf-8")
    return folder


def tiny_cfg(data, out=None, **kw):
    args = dict(data=str(data), out=str(out) if out else None, vocab_size=300, seq_len=16, batch_size=4, steps=2,
                lr=1e-3, warmup=1, log_every=1, save_every=0, eval_every=0, eval_batches=1, progress=False,
                device="cpu")
    args.update(kw)
    return TrainConfig(**args)


def tiny_model(vocab=300):
    return LMConfig(vocab_size=vocab, d_model=16, n_layers=1, n_heads=1, mixer="linear-elu+1", max_seq_len=64)


# ----------------------------------------------------------------------------- 1. streaming


def test_cap_bounds_the_read(tmp_path):
    """Nothing beyond --max-data-bytes is read: a file whose tail (past the cap) is not UTF-8 is fine."""
    good = "".join(f"line {i} of text\n" for i in range(2000))
    (tmp_path / "big.txt").write_bytes(good.encode() + b"\xff\xfe\x00" * 10000)
    docs = read_documents(tmp_path / "big.txt", max_bytes=5000)
    assert len(docs) == 1 and docs[0].text.endswith("\n") and len(docs[0].text.encode()) <= 5000
    assert docs[0].text == good[:len(docs[0].text)] and len(docs[0].text.encode()) > 5000 - 20
    d = tmp_path / "d"
    d.mkdir()
    (d / "a.txt").write_bytes(good.encode() + b"\xff" * 100)
    docs = read_documents(d, max_bytes=3000)
    assert [x.name for x in docs] == ["a.txt"] and len(docs[0].text.encode()) <= 3000


def test_segments_are_bounded_canonical_and_change_no_token(tmp_path):
    text = words_text(6000, seed=3) + "z" * 3000 + words_text(500, seed=4)
    segs = sources.split_text(text, max_chars=700)
    assert "".join(segs) == text and max(map(len, segs)) <= 700 and len(segs) > 10
    rng = random.Random(0)
    for _ in range(5):   # the same segments however the text arrives
        cuts = sorted(rng.sample(range(1, len(text)), 40))
        blocks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert list(sources.segments(blocks, max_chars=700)) == segs
    tok = train_tokenizer([text], vocab_size=400)
    # cuts at safe boundaries change no token: only the forced cuts inside the 3000 "z" differ
    plain = words_text(6000, seed=5)
    whole = tok.encode(plain)
    pieces = [i for s in sources.split_text(plain, max_chars=300) for i in tok.encode(s)]
    assert pieces == whole


def test_tokenizer_is_trained_on_bounded_segments(tmp_path, monkeypatch):
    seen = []
    real = tok_mod._train_in_thread

    def spy(tok, items, trainer, stop, **kw):
        def tee():
            for x in items:
                seen.append(len(x))
                yield x
        return real(tok, tee(), trainer, stop, **kw)

    monkeypatch.setattr(tok_mod, "_train_in_thread", spy)
    text = words_text(60000, seed=1)            # one document of ~300K characters
    assert len(text) > 3 * sources.SEGMENT_CHARS
    tok = train_tokenizer([text], vocab_size=320)
    assert seen and max(seen) <= sources.SEGMENT_CHARS and sum(seen) == len(text)
    # the same tokenizer as one trained on the whole text (the pieces only cut at safe boundaries)
    monkeypatch.setattr(tok_mod, "segments", lambda blocks: iter(list(blocks)))
    whole = train_tokenizer([text], vocab_size=320)
    assert json.loads(tok.to_str())["model"] == json.loads(whole.to_str())["model"]


def test_prepare_streams_into_a_memmapped_cache(tmp_path):
    data = write_corpus(tmp_path / "data")
    cfg = tiny_cfg(data, tmp_path / "run", val_fraction=0.2)
    d = prepare_data(cfg)
    assert d.cache is not None and d.cache.parent == tmp_path / "run" / "data_cache" and not d.reused
    assert isinstance(d.train.tokens, np.memmap) and d.train.tokens.dtype == np.uint16
    # the same tokens as the in-memory path, and the same fingerprint (a resume of an older run still matches)
    tr, va = split_documents(load_corpus(data), 0.2)
    ref_tr, ref_va = tokenize_documents(tr, d.tokenizer), tokenize_documents(va, d.tokenizer)
    assert np.array_equal(np.asarray(d.train.tokens, dtype=np.int64), ref_tr.numpy())
    assert np.array_equal(np.asarray(d.val.tokens, dtype=np.int64), ref_va.numpy())
    assert d.fingerprint == token_fingerprint(ref_tr) + "/" + token_fingerprint(ref_va)
    x, y = d.train.get_batch(0, 4, seed=0)
    ref = PackedTokens(ref_tr, 16).get_batch(0, 4, seed=0)
    assert x.dtype == torch.int64 and torch.equal(x, ref[0]) and torch.equal(y, ref[1])
    names = sorted(p.name for p in d.cache.parent.iterdir())
    assert len(names) == 3 and not any(n.startswith(".tmp") for n in names)   # tokenizer, tokens, metadata
    # a rerun finds everything in the cache: same tokens, no new files
    d2 = prepare_data(cfg)
    assert d2.reused and d2.cache == d.cache and d2.fingerprint == d.fingerprint
    assert d2.tokenizer.to_str() == d.tokenizer.to_str()
    assert sorted(p.name for p in d.cache.parent.iterdir()) == names
    # other data (a file changed): a new entry replaces the old one
    (data / "doc00.txt").write_text(words_text(1400, seed=99), encoding="utf-8")
    d3 = prepare_data(cfg)
    assert not d3.reused and d3.cache != d.cache and not d.cache.exists()
    assert len([p for p in d3.cache.parent.iterdir() if p.name.startswith("tokens-")]) == 2


def test_train_and_resume_reuse_the_cache(tmp_path):
    data = write_corpus(tmp_path / "data", n_files=1, n_words=4000)   # one file: split by text
    out = tmp_path / "run"
    res = train(tiny_cfg(data, out, steps=2), tiny_model())
    cache = sorted((out / "data_cache").glob("tokens-*.bin"))
    assert len(cache) == 1 and res.step == 2
    ino = cache[0].stat().st_ino
    res2 = train(tiny_cfg(data, out, steps=4), tiny_model(), resume=True)   # tokenizer from the checkpoint
    assert res2.step == 4 and sorted((out / "data_cache").glob("tokens-*.bin")) == cache
    assert cache[0].stat().st_ino == ino


def test_progress_bar_per_phase(tmp_path, capsys):
    data = write_corpus(tmp_path / "data", n_files=3)
    prepare_data(tiny_cfg(data, tmp_path / "run", progress=True))
    err = capsys.readouterr().err
    for phase in ("reading", "tokenizer", "tokenizing"):
        assert phase in err, err
    prepare_data(tiny_cfg(data, tmp_path / "run2", progress=False))
    assert capsys.readouterr().err == ""


def test_token_file_dtype_follows_the_vocabulary():
    assert prep_mod.token_dtype(4096) == np.uint16 and prep_mod.token_dtype(65536) == np.uint16
    assert prep_mod.token_dtype(65537) == np.uint32


# ----------------------------------------------------------------------------- 2. long lines, interrupts


@pytest.mark.parametrize("line", ["a" * 5000, "".join(random.Random(0).choice("ACGT") for _ in range(5000)),
                                  " " * 5000])
def test_pre_tokenized_pieces_are_bounded(line):
    tok = train_tokenizer(["some words here\n" * 20], vocab_size=300)
    pieces = tok.backend.pre_tokenizer.pre_tokenize_str(line + " end")
    assert max(len(p) for p, _ in pieces) <= MAX_PIECE_CHARS
    assert tok.decode(tok.encode(line)) == line
    # ordinary text is pre-tokenized as by the plain byte-level rule
    from tokenizers import pre_tokenizers

    plain = pre_tokenizers.ByteLevel(add_prefix_space=False)
    text = words_text(500)
    assert tok.backend.pre_tokenizer.pre_tokenize_str(text) == plain.pre_tokenize_str(text)


def test_a_200kb_line_without_spaces_trains_and_prepares(tmp_path):
    rng = random.Random(0)
    (tmp_path / "dna.txt").write_text("".join(rng.choice("ACGT") for _ in range(200_000)) + "\n" + "a" * 200_000,
                                      encoding="utf-8")
    p = prepare_tokens(tmp_path / "dna.txt", vocab_size=400, val_fraction=0.1, cache_dir=tmp_path / "cache")
    assert len(p.train) > 1000 and len(p.val) > 100
    assert all(len(x) <= MAX_PIECE_CHARS for x, _ in p.tokenizer.backend.pre_tokenizer.pre_tokenize_str("A" * 5000))


def test_interrupt_while_training_the_tokenizer_is_prompt():
    """A Ctrl-C reaches the caller while the tokenizer library is still busy (here: a stand-in that
    waits until released, as its merges would) and the training iterator is told to stop."""
    release = threading.Event()

    class BusyTokenizer:
        def train_from_iterator(self, items, trainer):
            next(items)
            os.kill(os.getpid(), signal.SIGINT)
            release.wait(30)

    stop = threading.Event()
    items = iter(["x"] * 10)
    # Python's Ctrl-C handler, whatever started the tests (a shell's background job ignores SIGINT,
    # and Python then keeps it ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            tok_mod._train_in_thread(BusyTokenizer(), items, None, stop, poll_s=0.01)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert stop.is_set()
    release.set()


def test_interrupt_while_tokenizing_leaves_no_cache_file(tmp_path, monkeypatch):
    data = write_corpus(tmp_path / "data", n_files=4)
    tok = train_tokenizer([words_text(3000)], vocab_size=300)
    monkeypatch.setattr(prep_mod, "BATCH_CHARS", 2000)
    calls = []
    real = type(tok).encode_batch

    def interrupted(self, texts):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, texts)

    monkeypatch.setattr(type(tok), "encode_batch", interrupted)
    cache = tmp_path / "cache"
    with pytest.raises(KeyboardInterrupt):
        prepare_tokens(data, tokenizer=tok, cache_dir=cache)
    assert len(calls) == 3 and list(cache.iterdir()) == []
    # the command line: one line, exit code 130, no partial file
    from linattn.cli import main

    calls.clear()
    out = tmp_path / "run"
    rc = main(["train", "--data", str(data), "--out", str(out), "--vocab-size", "300", "--steps", "2",
               "--seq-len", "16", "--batch-size", "2", "--d-model", "16", "--n-layers", "1", "--n-heads", "1",
               "--no-progress", "--device", "cpu"])
    assert rc == 130 and len(calls) == 3
    left = [p.name for p in (out / "data_cache").iterdir()]
    assert not any(n.startswith("tokens-") or n.startswith(".tmp") for n in left), left


def test_stale_temporary_files_are_removed(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    dead = cache / ".tmp-tokens-abc.bin.999999999"
    dead.write_bytes(b"partial")
    write_corpus(tmp_path / "data", n_files=2)
    prepare_tokens(tmp_path / "data", vocab_size=300, cache_dir=cache)
    assert not dead.exists()


# ----------------------------------------------------------------------------- 3. exotic files


def _run_guarded(fn, *args, **kw):
    """fn(*args, **kw) in a thread, so that a read that blocks (a FIFO) fails the test instead of hanging it."""
    box = {}

    def work():
        try:
            box["value"] = fn(*args, **kw)
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    t = threading.Thread(target=work, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "blocked reading the data"
    if "error" in box:
        raise box["error"]
    return box["value"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_fifo_in_a_folder_is_skipped_and_reported(tmp_path, capsys):
    d = write_corpus(tmp_path / "d", n_files=2, n_words=200)
    os.mkfifo(d / "pipe.txt")
    (d / "latin1.txt").write_bytes("café\n".encode("latin-1"))
    (d / "blob.bin").write_bytes(b"\x00\x01\x02abc")
    docs = _run_guarded(read_documents, d)
    assert [x.name for x in docs] == ["doc00.txt", "doc01.txt"]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    line = err[0]
    assert "skipped 3 files" in line and "1 not a regular file (pipe.txt: fifo)" in line
    assert "1 not UTF-8 text (latin1.txt)" in line and "1 binary (blob.bin" in line


@pytest.mark.skipif(not os.path.exists("/dev/zero") or sys.platform == "win32", reason="needs /dev/zero")
def test_symlink_to_a_device_is_not_read(tmp_path, capsys):
    d = write_corpus(tmp_path / "d", n_files=1, n_words=200)
    (d / "zero.txt").symlink_to("/dev/zero")
    docs = _run_guarded(read_documents, d)
    assert [x.name for x in docs] == ["doc00.txt"]
    assert "1 not a regular file (zero.txt: character device)" in capsys.readouterr().err
    with pytest.raises(CorpusError, match="character device.*zero.txt"):
        _run_guarded(read_documents, d / "zero.txt")
    # the training preparation too, with the summary line
    p = _run_guarded(prepare_tokens, d, vocab_size=300, val_fraction=0.0)
    assert len(p.manifest.files) == 1 and p.manifest.skipped == [("zero.txt", "not a regular file (character device)")]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_single_non_regular_or_binary_file_is_an_error_naming_it(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(CorpusError, match=r"fifo.*pipe"):
        _run_guarded(read_documents, tmp_path / "pipe")
    with pytest.raises(CorpusError, match=r"fifo.*pipe"):
        _run_guarded(prepare_tokens, tmp_path / "pipe")
    (tmp_path / "l1.txt").write_bytes("café\n".encode("latin-1"))
    with pytest.raises(CorpusError, match=r"not UTF-8 text.*l1.txt"):
        read_documents(tmp_path / "l1.txt")
    assert stat.S_ISFIFO(os.stat(tmp_path / "pipe").st_mode)


def test_skipped_summary_counts_and_examples():
    line = sources.skipped_summary([("a", "not UTF-8 text"), ("b", "not UTF-8 text"), ("c", "not UTF-8 text"),
                                    ("d", "not UTF-8 text"), ("p", "not a regular file (fifo)")], "data")
    assert line == ("skipped 5 files in data: 4 not UTF-8 text (a, b, c, +1 more); "
                    "1 not a regular file (p: fifo)")
    assert sources.skipped_summary([]) is None


# ----------------------------------------------------------------------------- the benchmark


def test_bench_data_tiny(tmp_path):
    from linattn.bench import run_benchmark

    rc = run_benchmark("data", ["--mb", "0.2", "--vocab-size", "300", "--out", str(tmp_path / "res")])
    assert rc == 0
    res = json.loads(next((tmp_path / "res").glob("*.json")).read_text())
    row = res["rows"][0]
    assert row["tokens"] > 0 and row["peak_rss_mb"] > 0 and row["cold"]["seconds"]["tokenizing"] >= 0
    assert row["warm"]["reused"] is True
