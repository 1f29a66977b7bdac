import os
import sys

import pytest
import torch

# tests import the plain fp64 references from tests/reference.py
sys.path.insert(0, os.path.dirname(__file__))

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
