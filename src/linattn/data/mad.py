"""The six MAD tasks (Poli et al. 2024, "Mechanistic Design and Scaling of Hybrid Architectures"),
generated as the benchmark's public code (athms/mad-lab, `mad/data/instances.py`) generates them.

Every generator returns one instance `(inputs, targets)`, two int64 numpy arrays of equal length,
drawn from a `numpy.random.Generator`. The conventions (see `docs/results/mad.md` and the tests):

* ignore index -100 in targets (no loss, no accuracy);
* recall tasks (in-context, noisy, fuzzy): a *training* instance is next-token prediction over the
  whole sequence (`inputs[:-1], inputs[1:]`: loss on every position, random keys and noise
  included); a *test* instance keeps only the recall positions (the value after a key that was
  seen before, and the final probe's value), everything else -100;
* memorization, compression and selective copying use the same format for training and test, and
  their targets are not shifted (they are aligned with the inputs).

Vocabularies (V = vocab_size):

* in-context recall: keys are the first half of the non-special vocabulary, values the second half
  (V = 16, multi-query: keys 0-7, values 8-15). Without multi_query the last token V-1 is a copy
  prefix placed before the final probe. noise_vocab_size tokens after the non-special ones are noise
  (noisy recall: V = 32, noise 16 -> keys 0-7, values 8-15, noise 16-31).
* fuzzy recall: pad V-1 (multi-query), keys 0..(V-1)//2-1, values up to V-2; keys and values are
  ordered tuples of 1..k_motif_size (1..v_motif_size) distinct tokens; test keys always have
  k_motif_size tokens; sequences are left-padded with the pad token to seq_len + 1 before the shift.
* memorization: insert token V-1; a fixed key -> value map over the other V-1 tokens (keys
  0..(V-1)//2-1, values from (V-1)//2), built once from `seed`; input `k, <insert>` repeated
  seq_len/2 times, target the value at the insert position.
* compression: seq_len-1 tokens from 0..V-2, then the compression token V-1; target = the input.
* selective copying: copy token V-1, blank V-2, content 0..V-3; num_tokens_to_copy content tokens
  with blanks inserted at random places, then `<copy>` and num_tokens_to_copy blanks; targets -100
  except the last num_tokens_to_copy positions, which hold the content tokens in order.

Differences from the public code, all distribution-preserving: random motifs are drawn directly
(`rng.choice(vocab, size, replace=False)`) instead of shuffling the list of all permutations and
picking one, and selective copying draws its blank positions from the same seeded generator
(the public code uses the global `np.random`, seeded by its training script). So a seed gives the
same data every time, but not the byte-identical data of mad-lab.

`make_dataset(task, num_train, num_test, seed)` builds a train and a test set with one generator
seeded with `seed` (train first, then test, as mad-lab does); `TASKS` holds each task's baseline
setting and the benchmark's difficulty sweep (`settings(task)`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from ..errors import ConfigError

IGNORE_INDEX = -100

Instance = Tuple[np.ndarray, np.ndarray]


def _rng(rng: Optional[np.random.Generator]) -> np.random.Generator:
    return rng if rng is not None else np.random.default_rng()


def _shifted(inputs: List[int], targets: List[int], is_training: bool) -> Instance:
    """Next-token format: inputs[:-1], and as targets inputs[1:] (training) or targets[1:] (test)."""
    x = np.asarray(inputs, dtype=np.int64)
    y = np.asarray(targets, dtype=np.int64)
    if is_training:
        return x[:-1], x[1:]
    return x[:-1], y[1:]


# ----------------------------------------------------------------------------------------------
# In-context recall (plain and noisy)
# ----------------------------------------------------------------------------------------------

def in_context_recall(vocab_size: int = 16, seq_len: int = 128, *, is_training: bool = True,
                      rng: Optional[np.random.Generator] = None, multi_query: bool = True,
                      noise_vocab_size: int = 0, frac_noise: float = 0.0,
                      ignore_index: int = IGNORE_INDEX) -> Instance:
    """One in-context recall instance: seq_len/2 - 1 (key, value) pairs then a probe pair.

    Keys are drawn uniformly with replacement; a key's value is drawn the first time it appears and
    stays fixed within the sequence; the probe repeats a key already presented. With frac_noise > 0
    each pair slot (except one random slot, always a real pair) is two noise tokens with
    probability frac_noise. Lengths: multi_query gives seq_len - 1 after the shift, otherwise the
    copy prefix adds a token and gives seq_len.
    """
    rng = _rng(rng)
    if seq_len % 2:
        raise ConfigError(f"seq_len must be even, got {seq_len}")
    if not 0 <= frac_noise < 1:
        raise ConfigError(f"frac_noise must be in [0, 1), got {frac_noise}")
    copy_prefix = vocab_size - 1
    n_plain = (vocab_size if multi_query else vocab_size - 1) - noise_vocab_size
    if n_plain < 2:
        raise ConfigError(f"vocab_size {vocab_size} leaves {n_plain} key/value tokens")
    key_vocab = np.arange(n_plain // 2)
    value_vocab = np.arange(n_plain // 2, n_plain)
    if frac_noise > 0:
        if noise_vocab_size < 1:
            raise ConfigError("noise_vocab_size must be > 0 when frac_noise > 0")
        noise_vocab = np.arange(n_plain, n_plain + noise_vocab_size)

    kv_map: Dict[int, int] = {}
    presented: Dict[int, int] = {}   # insertion-ordered: the probe is drawn from its keys
    inputs: List[int] = []
    targets: List[int] = []
    n_pairs = seq_len // 2
    real_slot = rng.choice(n_pairs)  # at least one real key-value pair
    for i in range(n_pairs - 1):     # the last slot is the probe
        is_noise = (rng.random() < frac_noise) if (i != real_slot and frac_noise > 0) else False
        if is_noise:
            inputs += [int(t) for t in rng.choice(noise_vocab, size=2, replace=True)]
            targets += [ignore_index, ignore_index]
            continue
        k = int(rng.choice(key_vocab))
        if k not in kv_map:
            kv_map[k] = int(rng.choice(value_vocab))
        v = kv_map[k]
        inputs += [k, v]
        targets.append(ignore_index)
        targets.append(v if (k in presented and multi_query) else ignore_index)
        presented[k] = v
    k_probe = int(rng.choice(list(presented.keys())))
    v_probe = presented[k_probe]
    if not multi_query:
        inputs.append(copy_prefix)
        targets.append(ignore_index)
    inputs += [k_probe, v_probe]
    targets += [ignore_index, v_probe]
    return _shifted(inputs, targets, is_training)


def noisy_in_context_recall(vocab_size: int = 32, seq_len: int = 128, *, noise_vocab_size: int = 16,
                            frac_noise: float = 0.2, is_training: bool = True,
                            rng: Optional[np.random.Generator] = None, multi_query: bool = True,
                            ignore_index: int = IGNORE_INDEX) -> Instance:
    """In-context recall with noise pairs (see `in_context_recall`); the benchmark's baseline is
    V = 32 with 16 noise tokens (keys 0-7, values 8-15, noise 16-31) and frac_noise 0.2."""
    return in_context_recall(vocab_size, seq_len, is_training=is_training, rng=rng, multi_query=multi_query,
                             noise_vocab_size=noise_vocab_size, frac_noise=frac_noise,
                             ignore_index=ignore_index)


# ----------------------------------------------------------------------------------------------
# Fuzzy in-context recall
# ----------------------------------------------------------------------------------------------

Motif = Tuple[int, ...]


def _motif(vocab: np.ndarray, size: int, rng: np.random.Generator) -> Motif:
    """A uniformly random ordered tuple of `size` distinct tokens of `vocab` (a permutation)."""
    return tuple(int(t) for t in rng.choice(vocab, size=size, replace=False))


@dataclass
class _FuzzyVocab:
    """The token sets of fuzzy recall: keys, values, noise (None without noise), pad, copy prefix."""
    keys: np.ndarray
    values: np.ndarray
    noise: Optional[np.ndarray]
    pad: int
    copy_prefix: int


def _fuzzy_vocab(vocab_size: int, k_motif_size: int, v_motif_size: int, multi_query: bool,
                 noise_vocab_size: int, frac_noise: float) -> _FuzzyVocab:
    """Split the vocabulary (pad V-1 with multi_query, else V-2; copy prefix V-1); check the sizes."""
    if not 0 <= frac_noise < 1:
        raise ConfigError(f"frac_noise must be in [0, 1), got {frac_noise}")
    n_plain = (vocab_size - 1 if multi_query else vocab_size - 2) - noise_vocab_size
    key_vocab = np.arange(n_plain // 2)
    value_vocab = np.arange(n_plain // 2, n_plain)
    if len(key_vocab) < k_motif_size or len(value_vocab) < v_motif_size:
        raise ConfigError(f"vocab_size {vocab_size} is too small for motifs of {k_motif_size}/{v_motif_size} tokens")
    noise_vocab = None
    if frac_noise > 0:
        if noise_vocab_size < 1:
            raise ConfigError("noise_vocab_size must be > 0 when frac_noise > 0")
        noise_vocab = np.arange(n_plain, n_plain + noise_vocab_size)
    return _FuzzyVocab(keys=key_vocab, values=value_vocab, noise=noise_vocab,
                       pad=vocab_size - 1 if multi_query else vocab_size - 2, copy_prefix=vocab_size - 1)


class _FuzzySequence:
    """A fuzzy recall sequence while it is drawn: tokens, targets, the keys' values so far, and
    whether the probe pair has been presented."""

    def __init__(self, vocab: _FuzzyVocab, k_motif_size: int, probe: Tuple[Motif, Motif], multi_query: bool,
                 ignore_index: int):
        self.vocab, self.multi_query, self.ignore_index = vocab, multi_query, ignore_index
        self.k_probe, self.v_probe = probe
        self.kv_map: Dict[int, Dict[Motif, Motif]] = {s: {} for s in range(1, k_motif_size + 1)}
        self.presented: Dict[Motif, Motif] = {}
        self.inputs: List[int] = []
        self.targets: List[int] = []
        self.probe_added = False

    def add_probe(self) -> None:
        """The probe pair at its random position (no targets)."""
        self.inputs += list(self.k_probe) + list(self.v_probe)
        self.targets += [self.ignore_index] * (len(self.k_probe) + len(self.v_probe))
        self.kv_map[len(self.k_probe)][self.k_probe] = self.v_probe
        self.presented[self.k_probe] = self.v_probe
        self.probe_added = True

    def add_noise(self, n: int, rng: np.random.Generator) -> None:
        self.inputs += [int(t) for t in rng.choice(self.vocab.noise, size=n, replace=True)]
        self.targets += [self.ignore_index] * n

    def add_pair(self, k_size: int, v_size: int, rng: np.random.Generator) -> None:
        """A random key motif and its value (the probe's value if it is the probe key); with
        multi_query the value is a target when the key was presented before."""
        k = _motif(self.vocab.keys, k_size, rng)
        if k == self.k_probe:
            v = self.v_probe
            self.probe_added = True
        elif k in self.kv_map[k_size]:
            v = self.kv_map[k_size][k]
        else:
            v = _motif(self.vocab.values, v_size, rng)
            self.kv_map[k_size][k] = v
        self.inputs += list(k) + list(v)
        self.targets += [self.ignore_index] * k_size
        self.targets += list(v) if (k in self.presented and self.multi_query) else [self.ignore_index] * len(v)
        self.presented[k] = v

    def add_final_probe(self) -> None:
        """The copy prefix (without multi_query), then the probe pair with its value as the target."""
        if not self.multi_query:
            self.inputs.append(self.vocab.copy_prefix)
            self.targets.append(self.ignore_index)
        self.inputs += list(self.k_probe) + list(self.v_probe)
        self.targets += [self.ignore_index] * len(self.k_probe) + list(self.v_probe)

    def left_pad(self, length: int) -> None:
        n_pad = length - len(self.inputs)
        if n_pad > 0:
            self.inputs = [self.vocab.pad] * n_pad + self.inputs
            self.targets = [self.ignore_index] * n_pad + self.targets


def _fuzzy_probe(vocab: _FuzzyVocab, key_sizes: List[int], value_sizes: List[int], seq_len: int,
                 rng: np.random.Generator) -> Tuple[Motif, Motif, int]:
    """The probe pair (key motif, value motif) and the position at which it is first presented."""
    k_probe_size = int(rng.choice(key_sizes))
    v_probe_size = int(rng.choice(value_sizes))
    k_probe = _motif(vocab.keys, k_probe_size, rng)
    v_probe = _motif(vocab.values, v_probe_size, rng)
    probe_idx = int(rng.choice(seq_len - 2 * (k_probe_size + v_probe_size)))
    return k_probe, v_probe, probe_idx


def fuzzy_in_context_recall(vocab_size: int = 16, seq_len: int = 128, *, k_motif_size: int = 3,
                            v_motif_size: int = 3, is_training: bool = True,
                            rng: Optional[np.random.Generator] = None, multi_query: bool = True,
                            noise_vocab_size: int = 0, frac_noise: float = 0.0,
                            ignore_index: int = IGNORE_INDEX) -> Instance:
    """Recall where keys and values are tuples of 1..k_motif_size (1..v_motif_size) distinct tokens.

    A probe pair is inserted at a random position and repeated at the end; training keys have random
    lengths, test keys always k_motif_size tokens. The sequence is left-padded with the pad token
    to seq_len + 1 tokens, then shifted as in `in_context_recall` (length seq_len).
    """
    rng = _rng(rng)
    vocab = _fuzzy_vocab(vocab_size, k_motif_size, v_motif_size, multi_query, noise_vocab_size, frac_noise)
    key_sizes = list(range(1, k_motif_size + 1)) if is_training else [k_motif_size]
    value_sizes = list(range(1, v_motif_size + 1))
    k_probe, v_probe, probe_idx = _fuzzy_probe(vocab, key_sizes, value_sizes, seq_len, rng)
    seq = _FuzzySequence(vocab, k_motif_size, (k_probe, v_probe), multi_query, ignore_index)
    body_len = seq_len - (len(k_probe) + len(v_probe)) - (k_motif_size + v_motif_size)
    while len(seq.inputs) < body_len:
        k_size = int(rng.choice(key_sizes))
        v_size = int(rng.choice(value_sizes))
        if len(seq.inputs) >= probe_idx and not seq.probe_added:
            seq.add_probe()
        elif frac_noise > 0 and rng.random() < frac_noise:
            seq.add_noise(k_size + v_size, rng)
        else:
            seq.add_pair(k_size, v_size, rng)
    seq.add_final_probe()
    seq.left_pad(seq_len + 1)
    return _shifted(seq.inputs, seq.targets, is_training)


# ----------------------------------------------------------------------------------------------
# Memorization
# ----------------------------------------------------------------------------------------------

def memorization_map(vocab_size: int = 256, seed: int = 12345) -> Dict[int, int]:
    """The fixed key -> value map of the memorization task for `vocab_size` (insert token V-1
    excluded): keys 0..(V-1)//2-1 and values (V-1)//2..V-2, each shuffled by a generator seeded
    with `seed`, zipped (so 127 pairs for V = 256)."""
    n = vocab_size - 1
    g = np.random.default_rng(seed)
    keys = np.arange(n // 2)
    values = np.arange(n // 2, n)
    g.shuffle(keys)
    g.shuffle(values)
    return {int(k): int(v) for k, v in zip(keys, values)}


def memorization(vocab_size: int = 256, seq_len: int = 32, *, kv_map: Optional[Dict[int, int]] = None,
                 rng: Optional[np.random.Generator] = None, seed: int = 12345,
                 ignore_index: int = IGNORE_INDEX, **_: Any) -> Instance:
    """`k, <insert>` repeated seq_len/2 times with uniformly drawn keys of the fixed map; the target
    at each insert position is the key's value (no shift)."""
    rng = _rng(rng)
    if seq_len % 2:
        raise ConfigError(f"seq_len must be even, got {seq_len}")
    if kv_map is None:
        kv_map = memorization_map(vocab_size, seed)
    insert = vocab_size - 1
    keys = np.asarray(list(kv_map.keys()))
    inputs: List[int] = []
    targets: List[int] = []
    for _ in range(seq_len // 2):
        k = int(rng.choice(keys))
        inputs += [k, insert]
        targets += [ignore_index, kv_map[k]]
    return np.asarray(inputs, dtype=np.int64), np.asarray(targets, dtype=np.int64)


# ----------------------------------------------------------------------------------------------
# Compression
# ----------------------------------------------------------------------------------------------

def compression(vocab_size: int = 16, seq_len: int = 32, *, rng: Optional[np.random.Generator] = None,
                **_: Any) -> Instance:
    """seq_len - 1 uniform tokens of 0..V-2 and the compression token V-1; the target is the input
    itself (reconstructed by an encoder-decoder from the last position's state)."""
    rng = _rng(rng)
    x = np.concatenate([rng.choice(vocab_size - 1, size=seq_len - 1, replace=True),
                        np.asarray([vocab_size - 1])]).astype(np.int64)
    return x, x.copy()


# ----------------------------------------------------------------------------------------------
# Selective copying
# ----------------------------------------------------------------------------------------------

def selective_copying(vocab_size: int = 16, seq_len: int = 256, *, num_tokens_to_copy: int = 16,
                      rng: Optional[np.random.Generator] = None, ignore_index: int = IGNORE_INDEX,
                      **_: Any) -> Instance:
    """num_tokens_to_copy content tokens with seq_len - 2 num_tokens_to_copy - 1 blanks inserted
    before random content positions, then `<copy>` and num_tokens_to_copy blanks. Targets: -100,
    except the last num_tokens_to_copy positions (the content tokens in order)."""
    rng = _rng(rng)
    n = num_tokens_to_copy
    if seq_len <= 2 * n + 1:
        raise ConfigError(f"seq_len must be > 2 * num_tokens_to_copy + 1, got {seq_len} and {n}")
    copy_token, blank = vocab_size - 1, vocab_size - 2
    n_blank = seq_len - 2 * n - 1
    content = rng.choice(vocab_size - 2, size=n, replace=True)
    at = rng.integers(0, n, size=n_blank)   # blanks go before content position `at` (as np.insert)
    body = np.insert(content, at, [blank] * n_blank)
    x = np.concatenate([body, [copy_token], [blank] * n]).astype(np.int64)
    y = np.concatenate([np.full(n + n_blank + 1, ignore_index), content]).astype(np.int64)
    return x, y


# ----------------------------------------------------------------------------------------------
# Task registry and datasets
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MADTask:
    name: str
    fn: Callable[..., Instance]
    baseline: Dict[str, Any]
    changes: Dict[str, List[Any]] = field(default_factory=dict)
    backbone: str = "lm"       # "lm" (causal language model) or "autoencoder" (compression)
    label: str = ""


TASKS: Dict[str, MADTask] = {t.name: t for t in (
    MADTask("in-context-recall", in_context_recall,
            dict(vocab_size=16, seq_len=128, num_train_examples=12_800, multi_query=True),
            dict(vocab_size=[32, 64, 128], seq_len=[256, 512, 1024], num_train_examples=[6400, 3200, 1600, 800]),
            label="In-Context Recall"),
    MADTask("fuzzy-in-context-recall", fuzzy_in_context_recall,
            dict(vocab_size=16, seq_len=128, num_train_examples=12_800, multi_query=True, k_motif_size=3,
                 v_motif_size=3),
            dict(vocab_size=[32, 64, 128], seq_len=[256, 512, 1024], num_train_examples=[6400, 3200, 1600, 800]),
            label="Fuzzy Recall"),
    MADTask("noisy-in-context-recall", noisy_in_context_recall,
            dict(vocab_size=32, noise_vocab_size=16, seq_len=128, num_train_examples=12_800, multi_query=True,
                 frac_noise=0.2),
            dict(vocab_size=[48, 80, 144], seq_len=[256, 512, 1024], num_train_examples=[6400, 3200, 1600, 800],
                 frac_noise=[0.4, 0.6, 0.8]),
            label="Noisy Recall"),
    MADTask("selective-copying", selective_copying,
            dict(vocab_size=16, seq_len=256, num_tokens_to_copy=16, num_train_examples=12_800),
            dict(vocab_size=[32, 64, 128], seq_len=[512, 1024], num_train_examples=[6400, 3200, 1600, 800],
                 num_tokens_to_copy=[32, 64, 96]),
            label="Selective Copy"),
    MADTask("compression", compression,
            dict(vocab_size=16, seq_len=32, num_train_examples=12_800),
            dict(vocab_size=[32, 64, 128], seq_len=[64, 128, 256], num_train_examples=[6400, 3200, 1600, 800]),
            backbone="autoencoder", label="Compress"),
    MADTask("memorization", memorization,
            dict(vocab_size=256, seq_len=32, num_train_examples=256),
            dict(vocab_size=[512, 1024, 2048, 4096, 8192]),
            label="Memorize"),
)}

NUM_TEST_EXAMPLES = 1_280
DATA_SEED = 12345          # MADConfig.seed


def settings(task: str, sweep: bool = True) -> List[Dict[str, Any]]:
    """The benchmark's settings of `task`: the baseline, then (sweep=True) each difficulty change,
    one factor at a time. Each setting holds the generator's keyword arguments plus
    num_train_examples and num_test_examples."""
    t = TASKS[task]
    base = dict(t.baseline, num_test_examples=NUM_TEST_EXAMPLES)
    out = [dict(base)]
    if sweep:
        for key, values in t.changes.items():
            for v in values:
                out.append(dict(base, **{key: v}))
    return out


def generate(task: str, n: int, rng: np.random.Generator, is_training: bool,
             **kwargs) -> Tuple[torch.Tensor, torch.Tensor]:
    """n instances of `task` as int64 tensors `[n, L]` (inputs, targets)."""
    t = TASKS[task]
    kw = {k: v for k, v in kwargs.items() if k not in ("num_train_examples", "num_test_examples")}
    if task == "memorization" and kw.get("kv_map") is None:
        kw["kv_map"] = memorization_map(kw.get("vocab_size", 256), DATA_SEED)
    if t.fn in (in_context_recall, noisy_in_context_recall, fuzzy_in_context_recall):
        kw["is_training"] = is_training
    xs, ys = [], []
    for _ in range(n):
        x, y = t.fn(rng=rng, **kw)
        xs.append(x)
        ys.append(y)
    if not xs:
        return torch.zeros(0, 0, dtype=torch.long), torch.zeros(0, 0, dtype=torch.long)
    return torch.from_numpy(np.stack(xs)), torch.from_numpy(np.stack(ys))


def make_dataset(task: str, num_train: Optional[int] = None, num_test: Optional[int] = None,
                 seed: int = DATA_SEED, **kwargs) -> Dict[str, torch.Tensor]:
    """A train and a test set of `task` with the baseline setting overridden by kwargs.

    One generator seeded with `seed` draws the training instances, then the test instances (the
    memorization map is also built from `seed`). Returns {"train_inputs", "train_targets",
    "test_inputs", "test_targets"}.
    """
    if task not in TASKS:
        raise ConfigError(f"unknown MAD task {task!r}; tasks are: {', '.join(TASKS)}")
    setting = dict(TASKS[task].baseline, **kwargs)
    n_train = int(num_train if num_train is not None else setting.get("num_train_examples", 12_800))
    n_test = int(num_test if num_test is not None else setting.get("num_test_examples", NUM_TEST_EXAMPLES))
    if task == "memorization":
        setting["kv_map"] = memorization_map(setting.get("vocab_size", 256), seed)
    rng = np.random.default_rng(seed)
    xtr, ytr = generate(task, n_train, rng, True, **setting)
    xte, yte = generate(task, n_test, rng, False, **setting)
    return {"train_inputs": xtr, "train_targets": ytr, "test_inputs": xte, "test_targets": yte}


__all__ = [
    "IGNORE_INDEX", "in_context_recall", "noisy_in_context_recall", "fuzzy_in_context_recall", "memorization",
    "memorization_map", "compression", "selective_copying", "MADTask", "TASKS", "settings", "generate",
    "make_dataset", "NUM_TEST_EXAMPLES", "DATA_SEED",
]
