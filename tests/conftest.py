"""Fixtures: an autouse leak check around every test, and MXNet warmed for the tests marked
``mxnet`` (the pure-Python modules' tests run without it). Helpers live in ``_helpers``."""
from __future__ import annotations

import gc
import signal
import sys

import pytest

from _helpers import known_stats, leaks, snapshot


def pytest_collection_finish(session):
    """Move what collection imported (MXNet, numpy, hypothesis, the test modules) out of the
    collector's reach: the leak check's ``gc.collect()`` after every test then walks only what
    the tests made (a tenth of a second less per test). Frozen objects are still freed by
    reference counting; only cycles among them, made before any test ran, stay."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def warm_mxnet():
    """Start MXNet's engine once so its own lazily opened files do not count as leaks."""
    import mxnet as mx
    import numpy as np

    import gluon_stream as gs

    (mx.nd.ones((2, 2)) + 1).asnumpy()
    loader = gs.StreamLoader(gs.FunctionSource([0], lambda k: np.zeros((4, 2))), batch_size=2,
                             batchify_fn=mx.gluon.data.dataloader.default_batchify_fn,
                             num_workers=1)
    list(loader)
    loader.close()
    del loader
    gc.collect()
    gc.freeze()  # what MXNet made at start, as pytest_collection_finish does
    yield


@pytest.fixture(scope="session")
def warm_matplotlib(tmp_path_factory):
    """matplotlib opens its font files lazily and keeps them open: not a leak of ours."""
    pytest.importorskip("matplotlib")
    known_stats().plot(tmp_path_factory.mktemp("warm") / "warm.png")


@pytest.fixture(autouse=True)
def leak_check(request):
    """Fail a test that leaves threads, child processes, fds or /dev/shm entries behind."""
    if request.node.get_closest_marker("mxnet"):
        request.getfixturevalue("warm_mxnet")
    before = snapshot()
    yield
    if request.node.get_closest_marker("no_leak_check"):
        return
    found = leaks(before)
    assert not found, f"resources leaked by {request.node.name}: {found}"


@pytest.fixture
def python() -> str:
    return sys.executable


@pytest.fixture
def sigint():
    """Ctrl-C raises KeyboardInterrupt during the test, even when the suite runs in a shell that
    ignores SIGINT (``nohup ... &`` starts it with SIG_IGN); the handler is restored after."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
