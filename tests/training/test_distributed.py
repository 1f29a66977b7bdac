"""Training on two CPU processes (gloo): `torchrun -m linattn train` with DDP gives the losses of one
process; FSDP resumes a one-process checkpoint, stops every rank after the same step when one rank
gets SIGTERM, saves once, and one process resumes that checkpoint to the end of the run."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as tdist

from linattn import checkpoint as ckpt
from linattn.models import LMConfig
from linattn.training import TrainConfig, read_metrics, train

pytestmark = pytest.mark.skipif(not (tdist.is_available() and tdist.is_gloo_available()),
                                reason="torch.distributed with gloo is needed")

STEPS = 20
FLAGS = dict(vocab_size=300, seq_len=32, batch_size=4, steps=STEPS, log_every=1, eval_every=0, eval_batches=2,
             warmup=2, threads=1, save_every=0, keep_last=10)
MODEL = dict(d_model=32, n_layers=2, n_heads=2, mixer=["gated-deltanet", "softmax"])
TOL = 1e-5


def train_config(out, data, **kw) -> TrainConfig:
    return TrainConfig(data=str(data), out=str(out), progress=False, device="cpu", **{**FLAGS, **kw})


def model_config() -> LMConfig:
    return LMConfig(vocab_size=FLAGS["vocab_size"], **MODEL)


def rel(a, b) -> float:
    return abs(a - b) / abs(b)


def agent_store():
    """The workers' rendezvous store, served by this process on a port the kernel picked when it bound it (what
    torchrun's agent does; the workers connect with TORCHELASTIC_USE_AGENT_STORE). A port found free, released and
    bound again by rank 0 seconds later, after its start-up, could be taken meanwhile by a test on another
    pytest-xdist worker or by anything else on the machine."""
    return tdist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    words = ["def", "return", "class", "self", "import", "for", "in", "if", "else", "x", "y", "lambda", "yield",
             "with", "as", "print", "value", "items", "range", "len"]
    for i in range(40):
        lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 9))) for _ in range(rng.randint(5, 15))]
        (d / f"doc{i:02d}.py").write_text("\n".join(lines) + "\n")
    return d


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """The one-process run: losses of every step, validation loss, final weights."""
    out = tmp_path_factory.mktemp("ref") / "run"
    n = torch.get_num_threads()
    try:
        res = train(train_config(out, corpus), model_config(), handle_signals=False)
    finally:
        torch.set_num_threads(n)
    return {"losses": [loss for _, loss in res.losses], "val_loss": res.val_loss,
            "weights": {k: v.detach().clone() for k, v in res.model.state_dict().items()}}


def test_torchrun_two_processes_give_the_losses_of_one(corpus, reference, tmp_path):
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "linattn",
           "train", "--data", str(corpus), "--out", str(out), "--mixer", "gated-deltanet,softmax", "--no-progress"]
    for k, v in {**FLAGS, **{k: v for k, v in MODEL.items() if k != "mixer"}}.items():
        cmd += ["--" + k.replace("_", "-"), str(v)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])   # printed once, by rank 0
    assert len(res.stdout.strip().splitlines()) == 1
    recs = read_metrics(out)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))      # every step once
    assert all(r["world_size"] == 2 for r in recs)
    assert max(rel(r["loss"], ref) for r, ref in zip(recs, reference["losses"])) <= TOL
    assert rel(summary["val_loss"], reference["val_loss"]) <= TOL
    assert [p.name for p in ckpt.list_checkpoints(out)] == [ckpt.step_dir_name(STEPS)]


def _fsdp_worker(rank: int, world: int, port: int, out: str, data: str, results: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), TORCHELASTIC_USE_AGENT_STORE="True")

    def sigterm_on_rank_1(step: int) -> bool:
        if rank == 1 and step == 11:
            os.kill(os.getpid(), signal.SIGTERM)
        return False

    res = train(train_config(out, data, parallel="fsdp"), None, resume=True, should_stop=sigterm_on_rank_1)
    Path(results, f"rank{rank}.json").write_text(json.dumps(
        {"step": res.step, "interrupted": res.interrupted, "signal": res.signal, "resumed_from": res.resumed_from}))


def test_fsdp_resume_sigterm_and_back_to_one_process(corpus, reference, tmp_path):
    import torch.multiprocessing as mp

    out = tmp_path / "run"
    first = train(train_config(out, corpus), model_config(), should_stop=lambda s: s == 5, handle_signals=False)
    assert first.interrupted and first.step == 5
    results = tmp_path / "results"
    results.mkdir()
    store = agent_store()
    ctx = mp.start_processes(_fsdp_worker, args=(2, store.port, str(out), str(corpus), str(results)), nprocs=2,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + 600
    while not ctx.join(timeout=5):
        assert time.monotonic() < deadline, "the two FSDP processes did not finish"
    del store
    ranks = [json.loads((results / f"rank{r}.json").read_text()) for r in range(2)]
    stop = ranks[0]["step"]
    assert stop in (11, 12) and all(r["step"] == stop and r["interrupted"] for r in ranks)   # the same step
    assert all(r["signal"] == signal.SIGTERM and r["resumed_from"] == 5 for r in ranks)
    assert [p.name for p in ckpt.list_checkpoints(out)] == [ckpt.step_dir_name(5), ckpt.step_dir_name(stop)]
    # one process continues the FSDP checkpoint to the end
    n = torch.get_num_threads()
    try:
        last = train(train_config(out, corpus), None, resume=True, handle_signals=False)
    finally:
        torch.set_num_threads(n)
    assert last.step == STEPS and last.resumed_from == stop
    recs = read_metrics(out)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    assert [r["world_size"] for r in recs] == [1] * 5 + [2] * (stop - 5) + [1] * (STEPS - stop)
    assert max(rel(r["loss"], ref) for r, ref in zip(recs, reference["losses"])) <= TOL
    for k, v in last.model.state_dict().items():
        torch.testing.assert_close(v, reference["weights"][k], rtol=1e-4, atol=1e-5)
