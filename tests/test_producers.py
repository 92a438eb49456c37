"""The producers' places: how many work at once, and which waiting work gets a place first."""
import threading
import time

import pytest

from gluon_stream import FunctionSource
from gluon_stream._stages.produce import ProducerPool, Throttle
from gluon_stream.errors import LoaderClosed

pytestmark = pytest.mark.fast


def _wait_until(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def _taker(throttle, rank, order, hold=None):
    def run():
        throttle.take(rank)
        order.append(rank)
        if hold is not None:
            hold.wait(10)
        throttle.give()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_waiting_work_takes_places_in_rank_order_not_arrival_order():
    """The loop needs shards by (epoch, position): a shard of the window queued after a
    generation ahead of a later shard (or of the next epoch) still gets the place first."""
    throttle = Throttle(1, 1)
    throttle.take((0, 0))
    order = []
    threads = []
    for rank in [(1, 0), (0, 7), (0, 3)]:  # arrival order
        threads.append(_taker(throttle, rank, order))
        _wait_until(lambda: throttle.waiting == len(threads))
    throttle.give()
    for thread in threads:
        thread.join(10)
    assert order == [(0, 3), (0, 7), (1, 0)]
    assert throttle.running == 0 and throttle.waiting == 0


def test_the_thread_that_gives_a_place_up_does_not_take_it_again_before_earlier_work():
    """A producer thread finishing a shard goes on to its next task at once, before the woken
    waiter runs: with an unordered throttle it took the place again, so a generation ahead of
    the next epoch ran while the window's shard the loop waited for stood by (the stragglers
    benchmark lost 10-30 % of some epochs to it)."""
    throttle = Throttle(1, 1)
    throttle.take((0, 5))
    order = []
    waiter = _taker(throttle, (0, 6), order)
    _wait_until(lambda: throttle.waiting == 1)
    throttle.give()  # this thread's shard is done ...
    throttle.take((1, 0))  # ... and its next task is a generation ahead of epoch 1
    assert order == [(0, 6)]  # the waiting shard had the place first
    throttle.give()
    waiter.join(10)
    assert throttle.running == 0 and throttle.waiting == 0


def test_a_closed_throttle_lets_every_waiter_go_with_loader_closed():
    throttle = Throttle(1, 1)
    throttle.take((0, 0))
    errors = []

    def wait():
        try:
            throttle.take((0, 1))
        except LoaderClosed as exc:
            errors.append(exc)
    threads = [threading.Thread(target=wait, daemon=True) for _ in range(3)]
    for thread in threads:
        thread.start()
    _wait_until(lambda: throttle.waiting == 3)
    throttle.close()
    for thread in threads:
        thread.join(10)
    assert len(errors) == 3 and throttle.waiting == 0


def test_more_places_let_the_next_in_rank_order_work():
    throttle = Throttle(1, 3)
    throttle.take((0, 0))
    order = []
    hold = threading.Event()
    threads = [_taker(throttle, rank, order, hold) for rank in [(0, 2)]]
    _wait_until(lambda: throttle.waiting == 1)
    threads.append(_taker(throttle, (0, 1), order, hold))
    _wait_until(lambda: throttle.waiting == 2)
    assert throttle.grow()
    _wait_until(lambda: order == [(0, 1)])
    throttle.set_active(3)
    _wait_until(lambda: order == [(0, 1), (0, 2)])
    assert throttle.running == 3 and not throttle.grow()
    hold.set()
    throttle.give()
    for thread in threads:
        thread.join(10)
    assert throttle.running == 0


def test_a_ctrl_c_while_a_producer_thread_starts_loses_no_thread(monkeypatch):
    """Ctrl-C lands in the main thread, which submits; in ``Thread.start()``'s wait for the new
    thread it leaves that thread running. The pool still counts it: no second thread of its
    name, no more than its bound, and close() joins it."""
    pool = ProducerPool(FunctionSource(range(1), lambda key: [[key]]), Throttle(1, 1))
    start, started = threading.Thread.start, []

    def start_then_interrupt(thread):
        start(thread)
        if not started:
            started.append(thread)
            raise KeyboardInterrupt  # as SIGINT delivered while start() waits for the thread

    release = threading.Event()
    monkeypatch.setattr(threading.Thread, "start", start_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        pool.executor.submit(release.wait, 10)
    monkeypatch.undo()
    for _ in range(3):  # more work than threads: the pool starts all it may
        pool.executor.submit(release.wait, 10)
    _wait_until(lambda: started[0].is_alive())
    names = sorted(t.name for t in threading.enumerate() if t.name.startswith(
        "gluon_stream-producer"))
    release.set()
    pool.close()
    assert names == ["gluon_stream-producer_0", "gluon_stream-producer_1"]
    assert not started[0].is_alive()  # close() joined it
