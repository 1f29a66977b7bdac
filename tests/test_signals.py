"""One stop flag (linattn.signals.StopFlag) for the trainer, the vision trainer and tokenizer training."""
import os
import signal

import pytest

import linattn.data.tokenizer as tok_mod
import linattn.training.run as run_mod
import linattn.vision.train as vision_train
from linattn.signals import StopFlag, StopRequested


def test_one_class_everywhere():
    assert run_mod.StopFlag is StopFlag and vision_train.StopFlag is StopFlag and tok_mod.StopFlag is StopFlag
    assert not hasattr(vision_train, "_Stop") and not hasattr(tok_mod, "_Stopped")


def test_signal_sets_the_flag_with_one_notice(capsys):
    with StopFlag() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signum == signal.SIGTERM and stop.requested and stop.is_set()
    assert capsys.readouterr().err == ("\n[linattn] SIGTERM: finishing the current step, saving, exiting (SIGINT "
                                       "again aborts at once; the last checkpoint stays intact)\n")
    with StopFlag(notice="\n[linattn vision] {signal}: finishing the step, saving, exiting") as stop:
        os.kill(os.getpid(), signal.SIGTERM)
    assert capsys.readouterr().err == "\n[linattn vision] SIGTERM: finishing the step, saving, exiting\n"


def test_set_from_code_and_raise_if_set():
    stop = StopFlag(enabled=False)
    stop.raise_if_set()
    stop.set()
    assert stop.requested and stop.signum is None
    with pytest.raises(StopRequested):
        stop.raise_if_set()


def test_tokenizer_iterator_ends_when_the_flag_is_set():
    stop = StopFlag(enabled=False)
    items = tok_mod._segmented(["a b", "c d", "e f"], stop)
    assert next(items)
    stop.set()
    with pytest.raises(StopRequested):
        next(items)
