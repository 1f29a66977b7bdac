import os

# Triton reads TRITON_INTERPRET when it is first imported, and other tests import it indirectly
# (torch.compile's inductor backend probes for it): without a GPU, set the interpreter up front so that
# tests/triton/test_kernels.py runs its kernels on CPU whatever ran before it.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and "TRITON_INTERPRET" not in os.environ:
    import torch as _torch

    if not _torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _single_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def one_thread():
    """Run a test on one thread (tiny tensors on 2 shared cores: threads only contend; bitwise comparisons).
    A whole file: `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    yield from _single_thread()


@pytest.fixture(scope="module")
def one_thread_module():
    """`one_thread` for a whole module, its module-scoped fixtures included (they run before function-scoped
    ones): `pytestmark = pytest.mark.usefixtures("one_thread_module")`."""
    yield from _single_thread()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small generated code-like corpus (`tests.helpers.make_corpus`), one per test module; the modules
    that need another kind of text define their own `corpus`."""
    from tests.helpers import make_corpus

    return make_corpus(tmp_path_factory.mktemp("data") / "corpus.txt")
