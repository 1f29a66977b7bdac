"""MAD generators (linattn.data.mad): shapes, vocabularies, masking, determinism, and the
benchmark's specific conventions (seed-code notes, part E)."""
import numpy as np
import pytest
import torch

from linattn.data import mad
from linattn.data.mad import IGNORE_INDEX


def rng(seed=0):
    return np.random.default_rng(seed)


# ---------------------------------------------------------------- in-context recall

def test_recall_train_is_shifted_inputs_on_every_position():
    x, y = mad.in_context_recall(16, 128, is_training=True, rng=rng())
    assert x.shape == y.shape == (127,)                         # multi-query: seq_len - 1 after the shift
    assert (y != IGNORE_INDEX).all()                            # loss on every position, keys included
    full = np.concatenate([x, y[-1:]])
    assert np.array_equal(x[1:], y[:-1]) and len(full) == 128


def test_recall_vocab_and_pairs():
    for s in range(20):
        x, y = mad.in_context_recall(16, 128, is_training=True, rng=rng(s))
        full = np.concatenate([x, y[-1:]])
        keys, vals = full[0::2], full[1::2]
        assert keys.min() >= 0 and keys.max() <= 7              # keys 0-7
        assert vals.min() >= 8 and vals.max() <= 15             # values 8-15
        seen = {}
        for k, v in zip(keys, vals):                            # a key's value is fixed within the sequence
            assert seen.setdefault(int(k), int(v)) == int(v)
        assert int(keys[-1]) in set(int(k) for k in keys[:-1])  # the probe key was presented before


def test_recall_test_masks_everything_but_recalls():
    for s in range(10):
        x, y = mad.in_context_recall(16, 128, is_training=False, rng=rng(s))
        assert x.shape == y.shape == (127,)
        full = np.concatenate([x, [0]])
        keys = full[0::2]
        kept = np.nonzero(y != IGNORE_INDEX)[0]
        assert len(kept) >= 1 and y[-1] != IGNORE_INDEX        # the final probe value is always scored
        for pos in kept:                                        # target at position p is token p + 1, a value
            t = pos + 1
            assert t % 2 == 1 and y[pos] == (x[t] if t < len(x) else y[-1])
            assert int(keys[t // 2]) in set(int(k) for k in keys[: t // 2])   # its key occurred earlier
        # every value after a repeated key is scored (multi-query)
        for i in range(1, 64):
            if int(keys[i]) in set(int(k) for k in keys[:i]):
                assert y[2 * i] != IGNORE_INDEX


def test_recall_single_query_has_copy_prefix():
    x, y = mad.in_context_recall(16, 128, is_training=False, rng=rng(3), multi_query=False)
    assert x.shape == (128,)                                    # the copy prefix adds one token
    assert x[-2] == 15                                          # <copy> = V - 1 before the probe key
    assert (y[:-1] == IGNORE_INDEX).all() and y[-1] != IGNORE_INDEX
    full = np.concatenate([x, y[-1:]])
    assert full[:-3].max() <= 14                                # keys/values exclude the prefix token


def test_noisy_recall_noise_tokens_and_masking():
    n_noise_pairs = 0
    for s in range(20):
        x, y = mad.noisy_in_context_recall(32, 128, is_training=False, rng=rng(s))
        full = np.concatenate([x, [0]])
        pairs = full.reshape(-1, 2)
        noise = (pairs >= 16).all(axis=1)
        assert ((pairs >= 16).any(axis=1) == noise).all()        # a slot is all noise or a real pair
        assert pairs[noise].max() <= 31
        n_noise_pairs += int(noise.sum())
        assert not noise[-1]                                    # the probe is real
        # noise never carries a target
        for i in np.nonzero(noise)[0]:
            for t in (2 * i, 2 * i + 1):
                if 0 < t:
                    assert y[t - 1] == IGNORE_INDEX
        xt, yt = mad.noisy_in_context_recall(32, 128, is_training=True, rng=rng(s))
        assert (yt != IGNORE_INDEX).all()                       # training: loss on noise too
    frac = n_noise_pairs / (20 * 63)
    assert 0.12 < frac < 0.28                                   # frac_noise 0.2


# ---------------------------------------------------------------- fuzzy recall

def test_fuzzy_recall_shapes_vocab_padding():
    for s in range(10):
        x, y = mad.fuzzy_in_context_recall(16, 128, is_training=True, rng=rng(s))
        assert x.shape == y.shape == (128,)
        full = np.concatenate([x, y[-1:]])
        assert full.min() >= 0 and full.max() <= 15
        pad = full == 15                                        # pad = V - 1, only on the left
        if pad.any():
            n = int(np.argmin(pad)) if not pad.all() else len(pad)
            assert pad[:n].all() and not pad[n:].any()
        xt, yt = mad.fuzzy_in_context_recall(16, 128, is_training=False, rng=rng(s))
        kept = yt[yt != IGNORE_INDEX]
        assert len(kept) >= 1 and kept.min() >= 7 and kept.max() <= 14   # targets are values 7-14
        assert (yt[: int((xt == 15).sum())] == IGNORE_INDEX).all()       # no target in the padding


def test_fuzzy_recall_test_probe_key_has_three_tokens():
    for s in range(10):
        x, y = mad.fuzzy_in_context_recall(16, 128, is_training=False, rng=rng(s))
        full = np.concatenate([x, [0]])
        tail = np.nonzero(y != IGNORE_INDEX)[0]
        # the final value motif is scored; the three tokens before it are the key (0-6)
        last_run = [int(tail[-1])]
        while len(last_run) < len(tail) and tail[-len(last_run) - 1] == last_run[-1] - 1:
            last_run.append(int(tail[-len(last_run) - 1]))
        first_val = min(last_run) + 1                           # position in x of the first value token
        key = full[first_val - 3:first_val]
        assert key.max() <= 6 and len(set(key.tolist())) == 3


# ---------------------------------------------------------------- memorization

def test_memorization_map_and_format():
    m = mad.memorization_map(256, seed=12345)
    assert len(m) == 127                                        # keys 0-126 zipped with shuffled values
    assert set(m) == set(range(127))
    assert all(127 <= v <= 254 for v in m.values()) and len(set(m.values())) == 127
    assert m == mad.memorization_map(256, seed=12345)           # fixed for a seed
    assert m != mad.memorization_map(256, seed=1)
    x, y = mad.memorization(256, 32, kv_map=m, rng=rng())
    assert x.shape == y.shape == (32,)
    assert (x[1::2] == 255).all()                               # <insert> = V - 1
    assert (y[0::2] == IGNORE_INDEX).all()                      # no shift: target at the insert position
    assert all(y[2 * i + 1] == m[int(x[2 * i])] for i in range(16))


# ---------------------------------------------------------------- compression, selective copying

def test_compression():
    x, y = mad.compression(16, 32, rng=rng())
    assert x.shape == y.shape == (32,)
    assert x[-1] == 15 and x[:-1].max() <= 14                   # compression token V - 1 at the end
    assert np.array_equal(x, y)                                 # reconstruct the whole input


def test_selective_copying():
    for s in range(5):
        x, y = mad.selective_copying(16, 256, num_tokens_to_copy=16, rng=rng(s))
        assert x.shape == y.shape == (256,)
        assert x[-17] == 15 and (x[-16:] == 14).all()           # <copy> = V - 1, then 16 blanks (V - 2)
        body = x[:-17]
        content = body[body != 14]
        assert len(content) == 16 and content.max() <= 13 and (body == 14).sum() == 223
        assert body[-1] != 14                                   # blanks go before content tokens (np.insert)
        assert (y[:-16] == IGNORE_INDEX).all()
        assert np.array_equal(y[-16:], content)                 # targets: the content in order, no shift


# ---------------------------------------------------------------- datasets

@pytest.mark.parametrize("task", list(mad.TASKS))
def test_make_dataset_deterministic_shapes_ranges(task):
    a = mad.make_dataset(task, 12, 5, seed=7)
    b = mad.make_dataset(task, 12, 5, seed=7)
    c = mad.make_dataset(task, 12, 5, seed=8)
    for k in a:
        assert torch.equal(a[k], b[k]), k
        assert a[k].dtype == torch.int64
    assert not torch.equal(a["train_inputs"], c["train_inputs"])
    V = mad.TASKS[task].baseline["vocab_size"]
    assert a["train_inputs"].shape[0] == 12 and a["test_inputs"].shape[0] == 5
    assert a["train_inputs"].shape[1] == a["test_inputs"].shape[1]
    for k in a:
        t = a[k]
        assert t.max() < V and ((t >= 0) | (t == IGNORE_INDEX)).all()
    assert (a["train_inputs"] >= 0).all()
    # train then test from one generator: the test set is not the train set's first examples
    assert not torch.equal(a["test_inputs"], a["train_inputs"][:5])


def test_settings_sweep_one_factor_at_a_time():
    s = mad.settings("in-context-recall")
    assert s[0] == dict(mad.TASKS["in-context-recall"].baseline, num_test_examples=1280)
    assert len(s) == 1 + 3 + 3 + 4
    for setting in s[1:]:
        diff = [k for k in setting if setting[k] != s[0][k]]
        assert len(diff) == 1
    assert len(mad.settings("memorization")) == 6
    assert mad.settings("noisy-in-context-recall")[1]["vocab_size"] == 48
    assert len(mad.settings("compression", sweep=False)) == 1


def test_bad_settings_raise_config_errors():
    from linattn.errors import ConfigError, LinattnError

    with pytest.raises(ConfigError, match="unknown MAD task"):
        mad.make_dataset("no-such-task", num_train=2, num_test=2)
    with pytest.raises(ConfigError, match="seq_len must be even"):
        mad.in_context_recall(16, 127, is_training=True, rng=rng())
    assert issubclass(ConfigError, LinattnError) and issubclass(ConfigError, ValueError)
