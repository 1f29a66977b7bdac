"""The trainer's messages go through `logging` (linattn.logs): the same lines on stderr by default, and an
application can raise the level or take the messages to its own handler."""
import logging
import subprocess
import sys

import pytest

from linattn.logs import DEFAULT_HANDLER, ROOT, get_logger
from linattn.training.loop import step_line
from linattn.training.run import RunFolder


def _foreign_warning(tmp_path):
    (tmp_path / "step_mine").mkdir()   # a step_* folder that is not a linattn checkpoint: one warning
    RunFolder(tmp_path).clear()


def test_default_lines_on_the_current_stderr(tmp_path, capsys):
    _foreign_warning(tmp_path)
    err = capsys.readouterr().err
    assert err == (f"[linattn] warning: {tmp_path} holds folders that are not linattn checkpoints, left as they "
                   f"are: step_mine\n")


def test_step_line_text():
    rec = {"step": 3, "loss": 2.5, "lr": 1e-3, "tokens_per_s": 1234.4}
    assert step_line(rec, 10) == "step 3/10 loss 2.5000 lr 1.00e-03 tok/s 1234"
    assert step_line({**rec, "val_loss": 2.25}, 10) == "step 3/10 loss 2.5000 val_loss 2.2500 lr 1.00e-03 tok/s 1234"


@pytest.fixture
def linattn_logger():
    root = logging.getLogger(ROOT)
    level, handlers = root.level, list(root.handlers)
    yield root
    root.setLevel(level)
    root.handlers[:] = handlers


def test_level_and_own_handler(tmp_path, capsys, linattn_logger):
    linattn_logger.setLevel(logging.ERROR)
    _foreign_warning(tmp_path)
    get_logger("training").info("an info line")
    assert capsys.readouterr().err == ""
    linattn_logger.setLevel(logging.INFO)
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    linattn_logger.removeHandler(DEFAULT_HANDLER)
    linattn_logger.addHandler(Keep())
    (tmp_path / "b").mkdir()
    _foreign_warning(tmp_path / "b")
    assert capsys.readouterr().err == ""
    assert [(r.name, r.levelno) for r in records] == [("linattn.training", logging.WARNING)]
    assert "holds folders that are not linattn checkpoints" in records[0].getMessage()


def test_no_duplicate_through_the_root_logger(tmp_path):
    """An application that configures the root logger does not get each line twice."""
    code = ("import logging, sys, pathlib; logging.basicConfig(stream=sys.stderr, format='ROOT %(message)s'); "
            "from linattn.training.run import RunFolder; p = pathlib.Path(sys.argv[1]); (p / 'step_x').mkdir(); "
            "RunFolder(p).clear()")
    err = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True).stderr
    assert err.count("holds folders") == 1 and "ROOT" not in err
