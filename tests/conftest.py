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


def _usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask: a container or `taskset` may allow fewer than
    os.cpu_count())."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# torch's threads in each test process: the usable CPUs shared among pytest-xdist's workers (PYTEST_XDIST_WORKER_COUNT;
# `make test` runs one per CPU), at most 2 (the tensors are small: more threads only contend). With 2 workers on 2
# CPUs each gets 1: 2 x 2 threads on 2 cores would oversubscribe them, and an OpenMP thread descheduled mid-call holds
# the whole call back. A test that needs more threads sets them itself (`_restore_threads` puts them back).
torch.set_num_threads(max(1, min(2, _usable_cpus() // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _restore_threads():
    """torch's thread count as the test found it, whatever the test set: under pytest-xdist the tests a worker runs
    after this one are not those that follow it in the file, so a count left behind would change them by chance."""
    n = torch.get_num_threads()
    yield
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


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


@pytest.hookimpl(tryfirst=True)  # the marks first: pytest-xdist's own hook turns them into the work units' names
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`--dist loadgroup`), a test that uses a module- or class-scoped fixture of its own module
    (a model built once, a site, a reference run) joins its module's group: the group runs on one worker, which builds
    the fixture once, where tests handed out one by one would have each worker build it. xdist hands out the largest
    groups first, the single tests after them. (This file's own module-scoped fixtures are cheap: not counted.)"""
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info is not None else ()
        if any(d.scope in ("module", "class") and d.func.__module__ != __name__ for ds in defs for d in ds):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0].replace("/", ".")))


class _GroupNames:
    """pytest-xdist 3.8 names a grouped test's work unit by appending `@group` to its nodeid (`item._nodeid`), which
    pytest 9.2 no longer reads (the nodeid is `item._id`, a structured NodeId): the groups were silently ignored and
    every test went out alone. Where xdist's name did not take, this gives the test that name itself."""

    @pytest.hookimpl(trylast=True)  # after xdist's hook
    def pytest_collection_modifyitems(self, config, items):
        if not getattr(config.option, "loadgroup", False):
            return
        try:
            from _pytest.nodeid import NodeId
        except ImportError:  # a pytest before 9.2: xdist's own name works
            return
        try:
            for item in items:
                names = {str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                         for m in item.iter_markers("xdist_group")}
                if names and "@" not in item.nodeid:
                    item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(sorted(names))}")
        except Exception as e:  # pytest's private NodeId changed: ungrouped (slower: fixtures built per worker)
            import warnings

            warnings.warn(f"xdist groups not applied ({type(e).__name__}: {e}); the suite runs ungrouped",
                          stacklevel=2)


def pytest_configure(config):
    config.pluginmanager.register(_GroupNames(), "linattn-xdist-group-names")
