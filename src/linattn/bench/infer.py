"""`linattn bench infer`: CPU inference of one model shape, prompt and decode tokens/s and decode time as a multiple
of the memory floor, for linattn's model and the same shape in transformers (its own PyTorch path and served by
`linattn.hf.kernelize`), fp32 / bf16 (and int8 / int4: the fp32 model through `linattn.quantize`), at each thread
count; llama.cpp as an optional peer row.

The floor of a decoded token (the one definition `linattn bench decode` uses too):

    floor = decode_bytes(model) / read bandwidth

* decode_bytes: the bytes every decoded token must read, in the stored dtype: every parameter and buffer once
  (shared ones once; int8 / int4 layers: their integers, bf16 scales and biases), the input embedding as one row
  rather than the table, the head's matrix once (a tied head is the embedding table, counted once; a quantized tied
  head is its own integers); the weights only: states, caches and activations are in the next floor;
* state_bytes (the second floor, "floor+st" = (decode_bytes + state_bytes) / read bandwidth): what a decoded token
  reads and writes in its cache besides the weights: every constant-size state (the recurrent states, in fp32 for
  Gated DeltaNet, and the short convolutions' windows) read once and written once, and each KV cache's keys and
  values read over the context and one new row written (`state_traffic`). The bench counts it at the decode's
  mean context, prompt + decode / 2, from a linattn model's cache of the same shape and dtype (the transformers
  and llama.cpp rows take the same count: their states are the same model's, stored as their engines store them);
* read bandwidth: the fastest of 3 passes reading a float32 buffer of at least 4x the last-level cache (and 64 MiB)
  with a compiled vectorised sum (`ReadBandwidth`), at the row's thread count, once per round, interleaved with the
  models' timings (the floor and the models see the same load); the table's bandwidth is the median over rounds.
  The buffer is on 2 MiB pages where the machine gives them (`linattn.cpu.hugepages`, as the models' weights are
  when a decode plan is built): the machine's best read rate, so the floor cannot flatter an engine whose weights
  sit on 4 KiB pages. The JSON's `bandwidth_pages` says how much of it the kernel put on huge pages.
* paired (`over_floor_paired`): a shared machine's read rate drifts between the round's pass and a row's decode
  (on the project's 2-vCPU VM one run's rounds differed by up to 12 %, runs by 33 %), so a pass is also taken
  right before each row's timed work, and each round's decode time is divided by the floor at that pass's rate;
  the column is the median of those ratios over the rounds (the JSON's `paired_rounds` has each round's decode ms
  and GB/s, and `decode_cpu_ms`: the process's CPU time per decoded token, all its threads, which a preemption on
  a loaded machine does not add to: a round slower in CPU time did more work).

Per round, every row in turn: one bandwidth pass (its paired rate), one prefill of --prompt tokens (timed: prompt
tok/s), then --decode greedy tokens on its cache (timed: decode tok/s); then the round's bandwidth pass; the table
gives medians over --repeats rounds. Before the first round at each thread count every model row runs one untimed
round of that exact work at that thread count (`warm_up`): the compiled decode plans are built per thread count,
and a first prefill / decode at the round's lengths sizes the KV caches and state buffers, so no timed round pays
a first call.
linattn's rows decode their tokens as its `generate(temperature=0)` does, all in one compiled call
(`decode_plan.model_greedy`: the whole-model step and the argmax in a C loop, no Python between tokens) where the
whole-model step covers the model, else one forward and one argmax per token as the transformers rows; the table's
"path" column and the JSON's `decode_path` say which ("greedy", "per-token"). The
shapes: "qwen3.5-530m" (hidden 1024, 24 layers of 3 Gated DeltaNet : 1 gated softmax attention, Qwen3.5-0.8B's
head layout, intermediate 3584, vocab 32k, tied head: 530M parameters), "qwen3.5-small" (the same layout at width
512, 8 layers, vocab 8k: 37M parameters, for a quick look) and "tiny" (for tests).

llama.cpp: `--llama-bench PATH` with `--gguf FILE` (a GGUF of the same weights per dtype: `--gguf fp32=a.gguf
bf16=b.gguf`) or `--llama-cpp DIR` (a llama.cpp source tree: its convert_hf_to_gguf.py converts the transformers
model, saved to a temporary folder, at each dtype, before the models are built) adds a row per dtype and thread
count: in every round one `llama-bench -p PROMPT -n DECODE -t THREADS -r 1 -o json` (its own warm-up and one
timed run), run right after the round's other rows of the same dtype, so the peer is re-measured in the same run
under the same load; its floor from that round's bandwidth, as every row's. llama.cpp runs as it ships (its
weights mmap'd from the GGUF: page cache, 4 KiB pages here); `--llama-args` passes its own options.
"""
from __future__ import annotations

import contextlib
import glob
import importlib.util
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

import torch

from ..cli_support import UsageError, int_at_least
from ..io import atomic_write_text, write_json
from . import common

DESCRIPTION = __doc__
PROG = "linattn bench infer"
#: model shapes: width, layers, one softmax layer in every `every`, vocab, FFN width, Gated DeltaNet heads and their
#: width, softmax heads, KV heads and their width
SHAPES: Dict[str, Dict[str, int]] = {
    "qwen3.5-530m": dict(d=1024, layers=24, every=4, vocab=32000, inter=3584, lin_heads=16, lin_dim=128,
                         attn_heads=8, kv_heads=2, attn_dim=256),
    "qwen3.5-small": dict(d=512, layers=8, every=4, vocab=8192, inter=1792, lin_heads=8, lin_dim=64, attn_heads=4,
                          kv_heads=2, attn_dim=128),
    "tiny": dict(d=64, layers=4, every=4, vocab=256, inter=128, lin_heads=2, lin_dim=32, attn_heads=2, kv_heads=1,
                 attn_dim=32),
}
ENGINES = ("linattn", "transformers", "kernelize")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: the fp32 model quantized by `linattn.quantize` (int4: group 32; plain: activations="float", the exact products;
#: "-a8": activations="int8", the library's default), and llama.cpp's
#: nearest GGUF types
QUANTIZED = ("int8", "int4", "int8-a8", "int4-a8")
GGUF_TYPES = {"fp32": "f32", "bf16": "bf16", "int8": "q8_0"}   # (convert_hf_to_gguf.py writes no Q4_0: --gguf)
MIN_BANDWIDTH_BYTES = 64 << 20


def add_arguments(p) -> None:
    """The options of `linattn bench infer`.

    Args:
        p: The argparse parser to add them to.
    """
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3.5-530m", help="model shape (default qwen3.5-530m)")
    p.add_argument("--engines", default=",".join(ENGINES),
                   help=f"comma list of {', '.join(ENGINES)} (default all; the transformers ones need linattn[hf])")
    p.add_argument("--dtypes", default="fp32,bf16",
                   help="comma list of fp32, bf16, int8, int4, int8-a8, int4-a8 (default fp32,bf16; int8 / int4: the "
                        "fp32 model through linattn.quantize with activations='float' (the exact products); -a8: "
                        "with activations='int8', the library's default for both modes)")
    p.add_argument("--threads", type=int_at_least(1), nargs="+", default=[1, 2], help="thread counts (default 1 2)")
    p.add_argument("--prompt", type=int_at_least(1), default=512, help="prompt tokens (default 512)")
    p.add_argument("--decode", type=int_at_least(1), default=128, help="decoded tokens per round (default 128)")
    p.add_argument("--repeats", type=int_at_least(1), default=5,
                   help="interleaved rounds (default 5; a llama.cpp row runs llama-bench -r 1 once per round)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompt (default 0)")
    p.add_argument("--llama-bench", default=None, metavar="PATH",
                   help="llama.cpp's llama-bench binary (optional): a row per GGUF, one llama-bench -r 1 per round, "
                        "run between the round's other rows")
    p.add_argument("--gguf", nargs="+", default=None, metavar="DTYPE=FILE",
                   help="GGUF files of the transformers model's weights for llama-bench, e.g. fp32=m.gguf")
    p.add_argument("--llama-args", default="", metavar="ARGS",
                   help="more arguments for llama-bench, one string (e.g. \"--repack 0\" where its repacked "
                        "Q4_0 / Q8_0 kernels use instructions the machine refuses)")
    p.add_argument("--llama-cpp", default=None, metavar="DIR",
                   help="a llama.cpp source tree: convert the model with its convert_hf_to_gguf.py")
    p.add_argument("--bandwidth-mib", type=int_at_least(1), default=None,
                   help="size of the bandwidth buffer (default: 4x the last-level cache, at least 64 MiB; a smaller "
                        "one is read partly from cache and is reported as such)")
    p.add_argument("--out", default=None, help="output folder (default results/bench/infer/)")
    p.add_argument("--overwrite", action="store_true", help="replace existing output files")
    p.add_argument("--quiet", action="store_true", help="no per-row progress on stderr")
    p.add_argument("--profile", action="store_true",
                   help="where a decoded token's time goes: the compiled plans run their timing build "
                        "(LINATTN_DECODE_TIMING) and a per-section table follows (a developer's tool)")


# -- the floor ---------------------------------------------------------------------------------------------------
def decode_bytes(model: torch.nn.Module, embed: torch.nn.Module, head: Optional[torch.nn.Module]) -> int:
    """The bytes one decoded token reads from `model`'s weights (module docstring): every parameter and buffer once
    in its stored dtype, `embed`'s table as one row unless `head` (None: tied) reads it whole.

    Args:
        model: The model.
        embed: Its input embedding (an nn.Embedding-like module with `.weight` `[vocab, d]`).
        head: Its output projection, or None when the embedding is the head.

    Returns:
        The bytes.
    """
    seen, total = set(), 0
    for m in model.modules():   # quantized layers' derived copies for torch's kernels ("_" buffers) are not read
        if callable(getattr(m, "stored_weights", None)):
            seen.update((t.data_ptr(), t.numel(), t.dtype) for n, t in m.named_buffers() if n.startswith("_"))
    for t in list(model.parameters()) + list(model.buffers()):
        key = (t.data_ptr(), t.numel(), t.dtype)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    w = embed.weight
    head_w = getattr(head, "weight", None)   # (a quantized head's is no tensor: its own integers, counted above)
    tied = head is None or (isinstance(head_w, torch.Tensor) and head_w.data_ptr() == w.data_ptr())
    if not tied:   # the table is read one row per token
        total -= (w.shape[0] - 1) * w.shape[1] * w.element_size()
    return total


def model_decode_bytes(model: torch.nn.Module) -> int:
    """`decode_bytes` of a linattn `LanguageModel` or a transformers causal LM."""
    if hasattr(model, "get_input_embeddings"):
        return decode_bytes(model, model.get_input_embeddings(), model.get_output_embeddings())
    return decode_bytes(model, model.embed, model.lm_head)


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size (Linux sysfs), or 32 MiB when unknown."""
    best = 0
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(path) as f:
                text = f.read().strip().upper()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            best = max(best, int(text.rstrip("KMG")) * mult)
        except ValueError:
            continue
    return best or 32 << 20


class ReadBandwidth:
    """Memory read bandwidth over a float32 buffer of at least 4x the last-level cache (and 64 MiB): `once()` reads
    it `passes` times at the current thread count and returns the fastest pass's bytes / second.

    The pass is the compiled `linattn_probe_read_sum` (cpu/csrc/probe.c: blocks split across the threads, 64
    independent vector lanes each, so it waits on memory, not on its own adds), a read as fast as a decode's weight
    stream; `method` says "compiled", or "torch sum" when the compiled kernels are off or cannot be built (torch's
    sum, slower at one thread: its floor is then an upper bound, and a decode can beat it).
    """

    def __init__(self, nbytes: Optional[int] = None, passes: int = 3):
        from ..cpu import bindings, hugepages

        nbytes = nbytes or max(4 * last_level_cache_bytes(), MIN_BANDWIDTH_BYTES)
        self.buf = hugepages.empty(nbytes // 4, torch.float32).fill_(1.0)   # (the pages touched once)
        self.nbytes, self.passes = self.buf.numel() * 4, passes
        self._lib, self._out = bindings.bind("probe"), torch.zeros(1, dtype=torch.float64)
        self.method = "torch sum" if self._lib is None else "compiled"
        huge = hugepages.tensor_huge_bytes([self.buf])
        #: how the buffer sits in memory: {"bytes", "huge_bytes" (the kernel's count on 2 MiB pages; None:
        #: unreadable), "unavailable" (why huge pages were not asked for; None: they were)}
        self.pages = {"bytes": self.nbytes, "huge_bytes": huge, "unavailable": hugepages.unavailable()}

    def describe_pages(self) -> str:
        """The buffer's pages in words, e.g. "100 % on 2 MiB pages"."""
        p = self.pages
        if p["huge_bytes"] is None:
            return "pages unknown"
        why = f"; {p['unavailable']}" if p["unavailable"] else ""
        return f"{100 * p['huge_bytes'] / max(1, p['bytes']):.0f} % on 2 MiB pages{why}"

    def _read(self) -> float:
        if self._lib is None:
            return float(self.buf.sum())
        self._lib("linattn_probe_read_sum", None, self.buf.numel(), self.buf.data_ptr(),
                  max(1, torch.get_num_threads()), self._out.data_ptr())
        return float(self._out)

    def once(self) -> float:
        best = float("inf")
        for _ in range(self.passes):
            t0 = time.perf_counter()
            self._read()
            best = min(best, time.perf_counter() - t0)
        return self.nbytes / best


def state_traffic(cache) -> Optional[Dict[str, int]]:
    """What one decoded token reads and writes in a linattn cache besides the weights.

    Args:
        cache: A linattn `Cache` (a model's `out.cache`); anything else gives None.

    Returns:
        {"state": bytes of the constant-size states (recurrent states, convolution windows, token shifts: each read
        and written once per token, so counted twice), "kv_row": bytes of one token's keys and values over every KV
        cache (written once per token; read once per token of context), "kv_tokens": the tokens the KV caches hold
        now}, or None.
    """
    from ..layers.cache import Cache, KVCache

    if not isinstance(cache, Cache):
        return None
    from torch.utils import _pytree as pytree

    state = kv_row = kv_tokens = 0
    for leaf in pytree.tree_leaves(cache.layers, is_leaf=lambda v: isinstance(v, KVCache)):
        if isinstance(leaf, KVCache):
            if leaf.k is not None:
                k, v = leaf.k, leaf.v
                kv_row += k.shape[0] * (k[0, 0].numel() * k.element_size() + v[0, 0].numel() * v.element_size())
                kv_tokens = max(kv_tokens, leaf.length)
        elif isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            state += 2 * leaf.numel() * leaf.element_size()
    return {"state": state, "kv_row": kv_row, "kv_tokens": kv_tokens}


def state_bytes(traffic: Optional[Dict[str, int]], context: float) -> Optional[float]:
    """`state_traffic`'s bytes for one token decoded at `context` tokens of context: the states, plus the KV rows
    read over the context and the one written (None for None)."""
    if traffic is None:
        return None
    return traffic["state"] + traffic["kv_row"] * (context + 1)


def weights_pages(model: torch.nn.Module) -> Optional[Dict[str, Any]]:
    """Where a model's weights sit after its decode plan was built (`linattn.cpu.hugepages`' last report on it):
    {"placed_bytes" (on huge-page mappings), "huge_bytes" (the kernel's count of those on 2 MiB pages now),
    "huge_capacity" (the most of them 2 MiB pages can cover: each storage's tail past its last 2 MiB boundary
    stays on 4 KiB pages), "skipped" (bytes left in place, by reason), "unavailable"}, or None where nothing placed
    it."""
    rep = getattr(model, "_linattn_hugepages", None)
    if rep is None:
        return None
    return {"placed_bytes": rep.placed_bytes + rep.already_bytes, "huge_bytes": rep.huge_bytes(),
            "huge_capacity": rep.huge_capacity(),
            "skipped": dict(rep.skipped), "unavailable": rep.reason}


# -- the models --------------------------------------------------------------------------------------------------
def linattn_model(shape: Dict[str, int], dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """linattn's `LanguageModel` of `shape`: Gated DeltaNet layers and one softmax layer (8 query / 2 KV heads of
    256 with an output gate, as Qwen3.5's) in every `every`, SwiGLU, tied head."""
    from ..models import LanguageModel, LMConfig

    s = shape
    mixers = ["softmax" if (i + 1) % s["every"] == 0 else "gated-deltanet" for i in range(s["layers"])]
    cfg = LMConfig(vocab_size=s["vocab"], d_model=s["d"], n_layers=s["layers"], n_heads=s["lin_heads"],
                   head_dim=s["lin_dim"], mixer=mixers, ffn_hidden=s["inter"], tie_embeddings=True,
                   mixer_kwargs={"softmax": dict(heads=s["attn_heads"], n_kv_heads=s["kv_heads"],
                                                 head_dim=s["attn_dim"], output_gate=True)})
    torch.manual_seed(seed)
    return LanguageModel(cfg).to(dtype).eval()


def build_model(engine: str, shape: Dict[str, int], dtype_name: str, seed: int) -> torch.nn.Module:
    """The model of one row by dtype name: `build_row`'s, or for int8 / int4 its fp32 model quantized."""
    if dtype_name in QUANTIZED:
        from ..quant import quantize

        mode, _, a8 = dtype_name.partition("-")
        return quantize(build_row(engine, shape, torch.float32, seed), mode, activations="int8" if a8 else "float",
                        inplace=True)
    return build_row(engine, shape, DTYPES[dtype_name], seed)


def build_row(engine: str, shape: Dict[str, int], dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """The model of one row: "linattn", "transformers" (its own PyTorch path) or "kernelize"."""
    if engine == "linattn":
        return linattn_model(shape, dtype, seed)
    from ..hf.infer_models import qwen35_model

    return qwen35_model(shape, dtype, seed, kernelized=engine == "kernelize")


class Runner:
    """Prefill then greedy decode of one model: `prefill(ids)` keeps the cache and the next token, `decode(n)`. A
    linattn model decodes its n tokens in one compiled call where the whole-model step covers it
    (`decode_plan.model_greedy`), else token by token, as transformers' models; `path` says which the last `decode`
    took ("greedy", "per-token")."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.hf = model, hasattr(model, "get_input_embeddings")
        if self.hf:
            import inspect

            params = inspect.signature(type(model).forward).parameters   # (kernelize wraps the instance's forward)
            self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.cache = self.tok = self.path = None

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor) -> None:
        if self.hf:
            out = self.model(ids, use_cache=True, logits_to_keep=1)
            self.cache = getattr(out, "cache", None) or out.past_key_values
        else:
            out = self.model(ids, use_cache=True, logits_to_keep=1)
            self.cache = out.cache
        self.tok = out.logits[:, -1:].argmax(-1)

    @torch.no_grad()
    def decode(self, n: int) -> float:
        """n greedy tokens; returns the seconds spent in the model's calls (the rest of the loop: the argmax; the
        greedy path: `model_greedy`'s call, its picks inside)."""
        clock, inside = time.perf_counter, 0.0
        if not self.hf:
            from ..models.decode_plan import model_greedy

            t0 = clock()
            got = model_greedy(self.model, self.tok, self.cache, n)
            inside = clock() - t0
            if got is not None:
                self.tok, self.path = got[0][:, -1:], "greedy"
                return inside
        self.path = "per-token"
        for _ in range(n):
            t0 = clock()
            if self.hf:
                out = self.model(self.tok, use_cache=True, **{self.cache_kw: self.cache})
                self.cache = getattr(out, "cache", None) or out.past_key_values
            else:
                out = self.model(self.tok, cache=self.cache)
            inside += clock() - t0
            self.tok = out.logits[:, -1:].argmax(-1)
        return inside


# -- llama.cpp ---------------------------------------------------------------------------------------------------
def parse_llama_bench(text: str) -> Dict[str, float]:
    """{"prompt_tok_s", "decode_tok_s"} from `llama-bench -o json` output (its records with n_prompt > 0 / n_gen >
    0 and their avg_ts)."""
    out = {}
    for rec in json.loads(text):
        if rec.get("n_prompt", 0) > 0 and rec.get("n_gen", 0) == 0:
            out["prompt_tok_s"] = float(rec["avg_ts"])
        elif rec.get("n_gen", 0) > 0 and rec.get("n_prompt", 0) == 0:
            out["decode_tok_s"] = float(rec["avg_ts"])
    return out


#: run inside a fresh interpreter: llama.cpp's convert_hf_to_gguf.py (argv: the source tree, then the script's own
#: arguments), its `conversion` and `gguf-py` packages first on the path, with the BPE pre-tokenizer named "qwen2":
#: the random model's stand-in tokenizer (`write_stand_in_tokenizer`) is no published model's, whose hash the
#: script would refuse, and llama-bench reads token ids only
_CONVERT = """
import runpy, sys
root = sys.argv[1]
sys.path[:0] = [root, root + "/gguf-py"]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
sys.argv = [root + "/convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert_command(llama_cpp: str, folder: str, gguf_type: str, out: str) -> List[str]:
    """The command converting the transformers model saved in `folder` to `out` (GGUF type `gguf_type`) with the
    llama.cpp source tree `llama_cpp` (its multi-token-prediction head left out: the random model has none)."""
    return [sys.executable, "-c", _CONVERT, llama_cpp, folder, "--outtype", gguf_type, "--no-mtp", "--outfile", out]


def _gguf_files(a, shape, dtypes: Sequence[str], tmp: str, log) -> Dict[str, str]:
    """dtype -> GGUF file: --gguf's, or converted into tmp with --llama-cpp's convert_hf_to_gguf.py."""
    if a.gguf:
        files = {}
        for item in a.gguf:
            name, _, path = item.partition("=")
            if name not in (*DTYPES, *QUANTIZED) or not path:
                raise UsageError(f"--gguf takes DTYPE=FILE with DTYPE in {', '.join((*DTYPES, *QUANTIZED))}, got "
                                 f"{item!r}", prog=PROG)
            if not os.path.isfile(path):
                raise UsageError(f"--gguf: no file {path!r}", prog=PROG)
            files[name] = path
        return files
    from ..hf.infer_models import write_stand_in_tokenizer

    model = build_row("transformers", shape, torch.float32, a.seed)
    model.save_pretrained(tmp)
    write_stand_in_tokenizer(tmp, shape["vocab"])
    del model
    files = {}
    for name in dtypes:
        if name not in GGUF_TYPES:
            log(f"no llama.cpp row for {name}: convert_hf_to_gguf.py cannot write it (pass --gguf {name}=FILE)")
            continue
        out = os.path.join(tmp, f"model-{name}.gguf")
        log(f"converting to {out}")
        res = subprocess.run(convert_command(a.llama_cpp, tmp, GGUF_TYPES[name], out), capture_output=True,
                             text=True)
        if res.returncode != 0 or not os.path.isfile(out):
            raise RuntimeError(f"llama.cpp's convert_hf_to_gguf.py failed ({res.returncode}) on the {name} model:\n"
                               + "\n".join((res.stderr or res.stdout).strip().splitlines()[-12:]))
        files[name] = out
    return files


def llama_rows(files: Dict[str, str], rows: List[Dict[str, Any]], threads: Sequence[int]) -> List[Dict[str, Any]]:
    """The llama.cpp rows, one per GGUF in `files` (dtype -> path) whose dtype has model rows: each placed in `rows`
    right after the last model row of its dtype (returned: the new order). Their bytes: the transformers model's
    decode bytes of that dtype (the GGUF holds its weights), else linattn's; their state traffic the same model's."""
    out = list(rows)
    for name, path in files.items():
        same = [r for r in rows if r["dtype"] == name]
        if not same:
            continue
        hf = [r for r in same if r["engine"] != "linattn"]
        src = (hf or same)[0]
        row = {"engine": "llama.cpp", "dtype": name, "gguf": path, "bytes": src["bytes"],
               "state_bytes": src.get("state_bytes"), "times": {t: {"prefill": [], "decode": []} for t in threads}}
        out.insert(out.index(same[-1]) + 1, row)
    return out


def _llama_bench(a, path: str, threads: int, log) -> Dict[str, float]:
    """One `llama-bench` run (one timed repeat after its warm-up) on GGUF `path`: {"prompt_tok_s",
    "decode_tok_s"}."""
    cmd = [a.llama_bench, "-m", path, "-p", str(a.prompt), "-n", str(a.decode), "-t", str(threads),
           "-r", "1", "-o", "json", *shlex.split(a.llama_args)]
    log(" ".join(cmd))
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({res.returncode}): " + " ".join(cmd) + "\n"
                           + "\n".join(res.stderr.strip().splitlines()[-12:]))
    got = parse_llama_bench(res.stdout)
    if set(got) != {"prompt_tok_s", "decode_tok_s"}:
        raise RuntimeError("llama-bench gave no prompt and decode rates: " + " ".join(cmd) + "\n" + res.stdout[-2000:])
    return got


# -- the run -----------------------------------------------------------------------------------------------------
def _lists(a):
    engines = [e.strip() for e in a.engines.split(",") if e.strip()]
    dtypes = [d.strip() for d in a.dtypes.split(",") if d.strip()]
    if not engines or any(e not in ENGINES for e in engines):
        raise UsageError(f"--engines: choose from {', '.join(ENGINES)}, got {a.engines!r}", prog=PROG)
    if not dtypes or any(d not in DTYPES and d not in QUANTIZED for d in dtypes):
        raise UsageError(f"--dtypes: choose from {', '.join((*DTYPES, *QUANTIZED))}, got {a.dtypes!r}", prog=PROG)
    if any(e != "linattn" for e in engines) and importlib.util.find_spec("transformers") is None:
        raise UsageError("--engines transformers / kernelize need transformers: pip install 'linattn[hf]'", prog=PROG)
    if a.llama_bench is not None:
        if a.llama_cpp is not None and not os.path.isfile(os.path.join(a.llama_cpp, "convert_hf_to_gguf.py")):
            raise UsageError(f"--llama-cpp: no convert_hf_to_gguf.py in {a.llama_cpp!r}", prog=PROG)
        if not os.path.isfile(a.llama_bench):
            raise UsageError(f"--llama-bench: no file {a.llama_bench!r}", prog=PROG)
        if not a.gguf and not a.llama_cpp:
            raise UsageError("--llama-bench needs --gguf DTYPE=FILE ... or --llama-cpp DIR", prog=PROG)
    return engines, dtypes


def _median(xs: List[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def warm_up(rows: List[Dict[str, Any]], a, threads: int) -> None:
    """Sets torch's thread count to `threads` and runs one untimed round of each model row's exact work there: a
    prefill of --prompt tokens, then --decode greedy tokens (as `_measure` times them). Rows already warmed at this
    thread count are skipped; llama.cpp's rows warm themselves (llama-bench's own warm-up run).

    Why the whole round, at the row's thread count: a compiled decode plan is built for the thread count it runs at
    (`decode_plan.PlanGuard`; both engines' plans now re-point the count instead of rebuilding); the warm-up
    used to run at torch's default count (2 on the project's VM) before `--threads 1`, so each row's first timed
    decode rebuilt its plan (the 530M shape: 0.1-0.8 s of CPU time, the fused weights copied again and their huge
    pages faulted in), 2.5-3.4x the later rounds' decode. A round's prefill length and decode count also size the
    KV caches and the state buffers the greedy loop rotates, so the warm-up runs those exact lengths
    (docs/cpu_kernels.md, Round 18b)."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(a.seed + 1)   # (not the rounds' generator: their prompts stay the same)
    for row in rows:
        if "runner" not in row or threads in row.setdefault("warmed", []):
            continue
        row["runner"].prefill(torch.randint(0, row["vocab"], (1, a.prompt), generator=gen))
        row["runner"].decode(a.decode)
        row["warmed"].append(threads)


def _measure(rows: List[Dict[str, Any]], a, bw: ReadBandwidth, log) -> Dict[int, List[float]]:
    """The interleaved rounds at every thread count: each row's prefill and decode times, one bandwidth pass per
    round. Returns the bandwidths by thread count."""
    bws: Dict[int, List[float]] = {t: [] for t in a.threads}
    gen = torch.Generator().manual_seed(a.seed)
    for t in a.threads:
        warm_up(rows, a, t)   # (no-op for the rows already warmed at t)
        for r in range(a.repeats):
            for row in rows:
                # the read rate of this moment, for the row's paired ratio (the VM's rate drifts between rows)
                row.setdefault("paired_bw", {}).setdefault(t, []).append(bw.once())
                if "gguf" in row:   # (llama-bench's own process and timing loop)
                    got = _llama_bench(a, row["gguf"], t, log)
                    row["times"][t]["prefill"].append(a.prompt / got["prompt_tok_s"])
                    row["times"][t]["decode"].append(1.0 / got["decode_tok_s"])
                    continue
                ids = torch.randint(0, row["vocab"], (1, a.prompt), generator=gen)
                run = row["runner"]
                t0 = time.perf_counter()
                run.prefill(ids)
                t1 = time.perf_counter()
                if a.profile:
                    _cpu_decode().section_times(reset=True)
                c1 = time.process_time()
                in_model = run.decode(a.decode)
                t2, c2 = time.perf_counter(), time.process_time()
                row["times"][t].setdefault("decode_cpu", []).append((c2 - c1) / a.decode)
                if a.profile:
                    row["sections"][t].append((t2 - t1, in_model, _cpu_decode().section_times(reset=True)))
                row["times"][t]["prefill"].append(t1 - t0)
                row["times"][t]["decode"].append((t2 - t1) / a.decode)
            bws[t].append(bw.once())
            log(f"threads {t} round {r + 1}/{a.repeats}: {bws[t][-1] / 1e9:.1f} GB/s")
    return bws


def _records(rows, a, bws) -> List[Dict[str, Any]]:
    out = []
    for t in a.threads:
        bw = _median(bws[t])
        for row in rows:
            pre, dec = _median(row["times"][t]["prefill"]), _median(row["times"][t]["decode"])
            floor_ms = None if row["bytes"] is None else row["bytes"] / bw * 1e3
            st = row.get("state_bytes")
            floor_st = None if st is None or floor_ms is None else (row["bytes"] + st) / bw * 1e3
            # each round's decode over the floor at the read rate measured right before it, the median of those
            pairs = list(zip(row["times"][t]["decode"], row.get("paired_bw", {}).get(t, [])))
            paired = None if row["bytes"] is None or not pairs else _median([d * b / row["bytes"] for d, b in pairs])
            cpu = row["times"][t].get("decode_cpu") or [None] * len(pairs)   # (llama.cpp's: another process)
            out.append({"engine": row["engine"], "dtype": row["dtype"], "threads": t, "bytes": row["bytes"],
                        "prompt_tok_s": a.prompt / pre, "decode_tok_s": 1.0 / dec, "decode_ms": dec * 1e3,
                        "floor_ms": floor_ms, "over_floor": None if floor_ms is None else dec * 1e3 / floor_ms,
                        "state_bytes": st, "floor_states_ms": floor_st,
                        "over_floor_states": None if floor_st is None else dec * 1e3 / floor_st,
                        "over_floor_paired": paired,
                        "paired_rounds": [{"decode_ms": d * 1e3, "bandwidth_gbs": b / 1e9,
                                           "decode_cpu_ms": None if c is None else c * 1e3}
                                          for (d, b), c in zip(pairs, cpu)],
                        "bandwidth_gbs": bw / 1e9, "weights_pages": row.get("weights_pages"),
                        "decode_path": row["runner"].path if "runner" in row else None})
            if a.profile:
                out[-1]["sections"] = profile_sections(row.get("sections", {}).get(t, []), a.decode)
    return out


def _cpu_decode():
    from ..cpu import decode

    return decode


def profile_sections(runs, tokens: int) -> Optional[Dict[str, Dict[str, float]]]:
    """{section: {"ms": per token, "bytes": per token}} of the median round (by decode time) from (decode seconds,
    seconds in the model's calls, `section_times`) of each round, so that the lines add up to its decode time: the
    compiled call's sections (cpu/decode.SECTIONS) and their sum "in call" (the whole C function), then the time
    outside it: "ctypes" (crossing into and out of the C function), "forward, python" (the model's forward around
    the call: the plan's guard, the buffers, the cache's bookkeeping), "loop" (the decode loop around the forward:
    the argmax), their sum "outside call", and "decode" (the round's wall time); None when no round ran the timing
    build (a row without a whole-model plan). A row on the greedy path (`Runner.path`) makes one call for all its
    tokens: the C loop's picks count in "logits" (and its copies in "setup" / "teardown") inside the call, "ctypes"
    is one crossing, "forward, python" `model_greedy`'s Python once, "loop" the runner around it."""
    got = sorted(((wall, inside, st) for wall, inside, st in runs if st is not None and st["tokens"] > 0),
                 key=lambda r: r[0])
    if not got:
        return None
    wall, inside, st = got[(len(got) - 1) // 2]
    per = lambda s: s / tokens * 1e3   # noqa: E731 (ms per decoded token)
    out: Dict[str, Dict[str, float]] = {}
    for name in _cpu_decode().SECTIONS[:-1]:
        out[name] = {"ms": per(st["seconds"][name]), "bytes": st["bytes"][name] / st["tokens"]}
    total, py = st["seconds"]["total"], st["python seconds"]
    out["in call"] = {"ms": per(total), "bytes": sum(v["bytes"] for v in out.values())}
    out["ctypes"] = {"ms": per(py - total), "bytes": 0.0}
    out["forward, python"] = {"ms": per(inside - py), "bytes": 0.0}
    out["loop"] = {"ms": per(wall - inside), "bytes": 0.0}
    out["outside call"] = {"ms": per(wall - total), "bytes": 0.0}
    out["decode"] = {"ms": per(wall), "bytes": 0.0}
    return out


def _profile_table(records) -> str:
    """Per row with sections: each section's ms per token, share of the decode, MB per token, GB/s and its time over
    the time its bytes take at the row's read rate."""
    lines = []
    for r in records:
        sec = r.get("sections")
        if not sec:
            continue
        total, bw = sec["decode"]["ms"], r["bandwidth_gbs"]
        rows = []
        for name, v in sec.items():
            if v["ms"] == 0 and v["bytes"] == 0:
                continue
            gbs = v["bytes"] / (v["ms"] * 1e6) if v["ms"] > 0 and v["bytes"] > 0 else None
            rows.append([name, f"{v['ms']:.3f}", f"{100 * v['ms'] / total:.1f}", f"{v['bytes'] / 1e6:.2f}",
                         "-" if gbs is None else f"{gbs:.1f}", "-" if gbs is None else f"{bw / gbs:.2f}"])
        lines.append(f"{r['engine']} {r['dtype']}, {r['threads']} thread(s): where a decoded token's time goes "
                     f"(the median round; read {bw:.1f} GB/s; in call + outside call = decode)")
        lines.append(common.format_table(["section", "ms/token", "% of decode", "MB/token", "GB/s", "x read time"],
                                         rows))
    return "\n\n".join(lines)


def _ratio(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _table(records) -> str:
    rows = [[r["engine"], r["dtype"], r["threads"], f"{r.get('prompt_tok_s') or 0:,.1f}",
             f"{r.get('decode_tok_s') or 0:,.2f}", common.fmt_ms(r.get("floor_ms")), _ratio(r.get("over_floor")),
             common.fmt_ms(r.get("floor_states_ms")), _ratio(r.get("over_floor_states")),
             _ratio(r.get("over_floor_paired")),
             "-" if r.get("bandwidth_gbs") is None else f"{r['bandwidth_gbs']:.1f}", r.get("decode_path") or "-"]
            for r in records]
    return common.format_table(["engine", "dtype", "threads", "prompt tok/s", "decode tok/s", "floor ms",
                                "decode/floor", "floor+st ms", "decode/floor+st", "paired", "read GB/s", "path"],
                               rows)


#: a row whose placed weights sit less than this share on 2 MiB pages gets a note under the table
PAGES_SHORT = 0.9


def pages_notes(records) -> List[str]:
    """One line per (engine, dtype) whose weights were placed on huge-page mappings but of which the kernel gave
    fewer than PAGES_SHORT of what 2 MiB pages can cover (`huge_capacity`: it found too few free 2 MiB blocks, as
    after long runs that fragmented memory): that row's decode then pays the 4 KiB pages' TLB misses and is not
    comparable with a run whose weights got their 2 MiB pages."""
    out, seen = [], set()
    for r in records:
        wp, key = r.get("weights_pages"), (r["engine"], r["dtype"])
        if key in seen or not wp or not wp.get("huge_capacity") or wp.get("huge_bytes") is None:
            continue
        seen.add(key)
        if wp["huge_bytes"] < PAGES_SHORT * wp["huge_capacity"]:
            out.append(f"note: {r['engine']} {r['dtype']}: {wp['huge_bytes'] / 1e6:,.0f} of the "
                       f"{wp['huge_capacity'] / 1e6:,.0f} MB of its weights that 2 MiB pages can cover are on them "
                       f"(the kernel had too few free 2 MiB blocks): its rows read slower than with all on 2 MiB "
                       f"pages; rerun when memory is less fragmented (as root: `echo 1 > /proc/sys/vm/compact_memory`)")
    return out


def _interleaved(a, engines: Sequence[str], dtypes: Sequence[str], shape, log, gguf: Dict[str, str]) -> tuple:
    """Builds every row's model (and the llama.cpp rows of the GGUFs in `gguf`) and the bandwidth buffer, prints
    the report's head, runs the interleaved rounds. Returns (the head's lines, the machine's description, the
    records, the bandwidth buffer's pages)."""
    rows = []
    for e in engines:
        for name in dtypes:
            model = build_model(e, shape, name, a.seed)
            rows.append({"engine": e, "dtype": name, "runner": Runner(model), "vocab": shape["vocab"],
                         "bytes": model_decode_bytes(model),
                         "times": {t: {"prefill": [], "decode": []} for t in a.threads},
                         "sections": {t: [] for t in a.threads}})
    bw = ReadBandwidth(None if a.bandwidth_mib is None else a.bandwidth_mib << 20)
    info = common.machine_info("cpu")
    head = [PROG, common.describe_machine(info),
            f"shape    {a.shape} {shape}",
            f"timing   prompt {a.prompt} tokens, {a.decode} decoded tokens per round, {a.repeats} interleaved "
            f"rounds (medians); threads {a.threads}",
            f"floor    decode bytes (stored dtype, embedding row, tied head once) / read bandwidth ({bw.method} "
            f"read of {bw.nbytes >> 20} MiB ({bw.describe_pages()}), LLC {last_level_cache_bytes() >> 20} MiB"
            f"{'' if bw.nbytes >= 4 * last_level_cache_bytes() else ': LESS THAN 4x, partly cached'}, "
            f"best of {bw.passes} passes once per round, median over rounds); floor+st: the same with the states "
            f"and KV rows a token reads and writes at the decode's mean context ({a.prompt + a.decode / 2:g} tokens)"]
    print("\n".join(head) + "\n")
    warm_up(rows, a, a.threads[0])
    for row in rows:
        row["traffic"] = state_traffic(row["runner"].cache)
        row["weights_pages"] = weights_pages(row["runner"].model)
    context = a.prompt + a.decode / 2   # (the decode's mean context)
    for row in rows:   # the same shape's count where the engine's cache is not linattn's: the same dtype first
        same = [r["traffic"] for r in rows if r["traffic"] is not None and r["dtype"] == row["dtype"]]
        any_ = [r["traffic"] for r in rows if r["traffic"] is not None]
        row["state_bytes"] = state_bytes(row["traffic"] or (same or any_ or [None])[0], context)
    rows = llama_rows(gguf, rows, a.threads)
    bws = _measure(rows, a, bw, log)
    return head, info, _records(rows, a, bws), bw.pages


def run(a) -> int:
    """Run the `linattn bench infer` benchmark (module docstring).

    Args:
        a: The options parsed with `add_arguments` (`linattn bench infer --help` lists them).

    Returns:
        The exit code (0: success).

    Raises:
        UsageError: Bad options.
    """
    engines, dtypes = _lists(a)
    log = (lambda s: None) if a.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    shape = SHAPES[a.shape]
    paths = common.output_paths("infer", a.out, exts=("txt", "json"), overwrite=a.overwrite)
    context = _fallbacks() if any(e != "linattn" for e in engines) else contextlib.nullcontext()
    if a.profile and _cpu_decode().timing_library() is None:
        raise UsageError("--profile needs the compiled CPU kernels (LINATTN_CPU_KERNELS on, a C compiler)", prog=PROG)
    switch = _cpu_decode().TIMING_SWITCH
    before = os.environ.get(switch)
    try:
        if a.profile:   # (read when each plan is built: before the models' warm-up)
            os.environ[switch] = "1"
        with tempfile.TemporaryDirectory(prefix="linattn-infer-") as tmp, context:
            # (converted first: the conversion builds its own copy of the model, freed before the rows' are built)
            gguf = _gguf_files(a, shape, dtypes, tmp, log) if a.llama_bench is not None else {}
            head, info, records, pages = _interleaved(a, engines, dtypes, shape, log, gguf)
    finally:
        if before is None:
            os.environ.pop(switch, None)
        else:
            os.environ[switch] = before
    loads = common.loadavg()
    text = "\n".join([_table(records)] + pages_notes(records)) + f"\n\nload average after the run: {loads}"
    if a.profile:
        text += "\n\n" + _profile_table(records)
    print(text)
    config = {k: v for k, v in vars(a).items() if not callable(v)}
    atomic_write_text(paths["txt"], "\n".join(head) + "\n\n" + text + "\n")
    write_json(paths["json"], {"benchmark": "infer", "machine": info, "config": config, "shape": shape,
                               "records": records, "bandwidth_pages": pages, "loadavg_after": loads})
    print(f"\nwrote {paths['txt']}, {paths['json']}")
    return 0


def _fallbacks():
    from ..hf.kernelize import torch_fallbacks

    return torch_fallbacks()


def floor_ms(model: torch.nn.Module, bandwidth: float) -> float:
    """One decoded token's floor in ms: `model_decode_bytes(model)` / bandwidth (bytes / s)."""
    return model_decode_bytes(model) / bandwidth * 1e3


__all__ = ["SHAPES", "ENGINES", "QUANTIZED", "ReadBandwidth", "Runner", "add_arguments", "build_model", "build_row",
           "decode_bytes", "floor_ms", "last_level_cache_bytes", "linattn_model", "model_decode_bytes",
           "pages_notes", "parse_llama_bench", "run", "state_bytes", "state_traffic", "warm_up", "weights_pages"]
