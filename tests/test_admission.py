"""The memory gate: bytes admitted against memory_budget before they are allocated, in the
order the loop needs them (gluon_stream._memory.gate). Pure: no MXNet."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import gluon_stream as gs
from gluon_stream._memory.gate import GiveWay, MemoryGate

MB = 1 << 20


def never() -> bool:
    return False


def in_thread(fn):
    """Run ``fn`` in a thread: (thread, box of its result or exception)."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the test
            box["error"] = exc

    thread = threading.Thread(target=run, name="gluon_stream-test-admission")
    thread.start()
    return thread, box


def test_a_later_shard_leaves_room_for_what_the_earlier_ones_still_expect():
    """Need order: shard 1 (submitted after shard 0, both expected at 10 MB raw and 10 MB
    copy once a shard of that size was seen) is not admitted into the room shard 0 still needs,
    even when its producer asks first; shard 0 always finds it."""
    gate = MemoryGate(25 * MB)
    seen = gate.open((0, -1), "shard seen", False)
    seen.made("raw", 10 * MB)
    seen.made("copy", 10 * MB)
    seen.release()
    first, second = gate.open((0, 0), "shard 0", False), gate.open((0, 1), "shard 1", False)
    thread, box = in_thread(lambda: second.reserve("raw", 10 * MB, never))
    thread.join(0.3)
    assert thread.is_alive() and gate.used == 0  # its 10 and shard 0's 20 expected: over 25
    first.reserve("raw", 10 * MB, never)
    first.reserve("copy", 10 * MB, never, exact=True)
    first.drop("raw")
    first.handed()  # the loop has it: shard 1 ranks first now
    thread.join(5)
    assert not thread.is_alive() and "error" not in box and gate.used == 20 * MB


def test_a_waiting_shard_holding_memory_gives_way_to_the_shard_the_loop_needs():
    """Shard 1 grew while shard 0 was made (its raw arrays are counted as made) and waits for
    its copy; shard 0 then waits for room only shard 1 holds: shard 1 gives way (frees its
    arrays, made again later), so the loop never deadlocks."""
    gate = MemoryGate(40 * MB)
    first, second = gate.open((0, 0), "shard 0", False), gate.open((0, 1), "shard 1", False)
    first.reserve("raw", 0, never)
    second.reserve("raw", 0, never)
    assert second.made("raw", 20 * MB)  # nothing known of shard 0's size yet
    assert first.made("raw", 15 * MB)
    thread, box = in_thread(lambda: second.reserve("copy", 20 * MB, never, exact=True))
    thread.join(0.3)
    assert thread.is_alive()
    waiter, got = in_thread(lambda: first.reserve("copy", 15 * MB, never, exact=True))
    thread.join(5)
    assert isinstance(box.get("error"), GiveWay)
    second.release()  # what the producer does with a failed shard
    waiter.join(5)
    assert not waiter.is_alive() and "error" not in got and gate.used == 30 * MB
    assert gate.peak <= 40 * MB and not gate.over


def test_a_later_shard_that_grew_beyond_its_reservation_is_made_again():
    """made() says False for a shard not ranked first whose arrays leave too little room for
    the shards before it: the stream frees it and makes it again when the loop reaches it."""
    gate = MemoryGate(40 * MB)
    seen = gate.open((0, -1), "shard seen", False)
    seen.made("raw", 10 * MB)
    seen.made("copy", 10 * MB)
    seen.release()
    first, second = gate.open((0, 0), "shard 0", False), gate.open((0, 1), "shard 1", False)
    first.reserve("raw", 10 * MB, never)
    second.reserve("raw", 10 * MB, never)
    assert not second.made("raw", 25 * MB)  # 10 + 25 held, shard 0's copy (10) expected
    assert first.made("raw", 12 * MB)  # ranked first: counted, never deferred


def test_a_shard_that_can_never_fit_is_refused_before_its_memory_is_used():
    gate = MemoryGate(30 * MB)
    adm = gate.open((0, 0), "shard 'k' (epoch 0)", True)
    adm.made("raw", 16 * MB)
    adm.made("transformed", 8 * MB)
    with pytest.raises(gs.MemoryBudgetTooSmall,
                       match=r"shard 'k' \(epoch 0\) needs 32.0 MiB at once \(its raw arrays "
                             r"16.0 MiB, transform's output 8.0 MiB, copy 8.0 MiB\), more than "
                             r"the whole memory_budget of 30.0 MiB"):
        adm.reserve("copy", 8 * MB, never, exact=True)
    assert adm.held["copy"] == 0


def test_a_closed_gate_wakes_its_waiters():
    gate = MemoryGate(10 * MB)
    held = gate.open((0, 0), "shard 0", False)
    held.reserve("raw", 10 * MB, never)
    held.handed()
    waiting = gate.open((0, 1), "shard 1", False)
    thread, box = in_thread(lambda: waiting.reserve("raw", 5 * MB, never))
    thread.join(0.3)
    assert thread.is_alive()
    gate.close()
    thread.join(5)
    assert isinstance(box.get("error"), gs.LoaderClosed)


def test_memory_of_views_counts_the_owner_once():
    """A transform's windows over the raw arrays add nothing; a memory-mapped file holds no
    memory of the process."""
    import numpy as np

    from gluon_stream._stages.produce import memory_of as _memory_of
    from gluon_stream.tools.generator import make_windows
    raw = np.zeros((150, 8), np.float32)
    counted: set = set()
    assert _memory_of((raw,), counted) == raw.nbytes
    assert _memory_of(make_windows(raw), counted) == 0
    assert _memory_of((raw[::2].copy(),), counted) == raw.nbytes // 2


def test_the_shard_the_loop_needs_is_admitted_even_when_only_its_own_progress_frees_room(
        monkeypatch, caplog):
    """Shards grew beyond every size seen, and the memory held belongs to the shard trained on
    (freed only once the loop has the next one): the shard ranked first waits for nothing to
    be given back for PATIENCE_S, then is admitted over the budget with a WARNING, rather
    than deadlock the loop."""
    from gluon_stream._memory import gate as admission
    monkeypatch.setattr(admission, "PATIENCE_S", 0.3)
    gate = MemoryGate(30 * MB)
    trained = gate.open((0, 0), "shard 0 (epoch 0)", False)
    trained.made("copy", 20 * MB)
    trained.handed()
    needed = gate.open((0, 1), "shard 1 (epoch 0)", False)
    assert needed.made("raw", 8 * MB)
    with caplog.at_level("WARNING", logger="gluon_stream._memory.gate"):
        needed.reserve("copy", 8 * MB, never, exact=True)
    assert gate.over == 1 and gate.used == 36 * MB
    assert "shard 1 (epoch 0) is admitted over the budget" in caplog.text
    assert "shard 0 (epoch 0) (handed out): copy 20.0 MiB" in caplog.text


def test_a_shard_whose_submitter_lost_its_future_gives_its_memory_back(monkeypatch):
    """A Ctrl-C inside ``submit`` (in ``Thread.start()``'s wait) reaches the loop after the
    work was queued: the stream never gets the future, so no done-callback releases the
    shard's admission. Whatever the queued work then does on the cancelled pass, the
    admission ends given back, or the budget would stay held for the stream's life (a guard:
    here the shard is made and freed; the next test holds the early failure)."""
    gate_seen: list = []
    stream = gs.ShardStream(gs.FunctionSource(range(4), lambda key: np.ones((64, 4))),
                            memory_budget=64 << 20, prefetch=1, producers=1)
    executor = stream._pool.executor
    submit = executor.submit

    def submit_then_interrupt(*args, **kwargs):
        submit(*args, **kwargs)  # queued: a producer thread runs it
        raise KeyboardInterrupt  # and the caller never sees the future

    with stream:
        gate_seen.append(stream.gate)
        run = stream.start_epoch()
        release = threading.Event()
        submit(release.wait, 10)  # the one producer is busy until the pass is cancelled
        monkeypatch.setattr(executor, "submit", submit_then_interrupt)
        with pytest.raises(KeyboardInterrupt):
            run.next_shard()
        monkeypatch.undo()
        run.cancel()  # as the loop does when the interrupt leaves the pass
        release.set()  # the queued shard now runs, on a cancelled pass
        deadline = time.monotonic() + 10
        while stream.gate.in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
    gate = gate_seen[0]
    # every admission given back: an open one would rank before every later shard for ever,
    # keeping room for what it still expects
    assert (gate.in_flight, gate.used) == (0, 0)


def test_a_shard_failing_before_it_is_made_gives_its_admission_back():
    """The early failure of the lost-future case above, directly: a pass cancelled before its
    queued shard runs. ``_produce`` gives the admission back itself (the done-callback that
    would is missing where the submitter lost the future)."""
    with gs.ShardStream(gs.FunctionSource(range(2), lambda key: np.ones((64, 4))),
                        memory_budget=64 << 20, prefetch=1, producers=1) as stream:
        run = stream.start_epoch()
        run.cancel()
        adm = stream.producer._open_admission(0, 0, 0)
        assert stream.gate.in_flight == 1
        with pytest.raises(gs.LoaderClosed):
            stream.producer._produce(0, 0, 0, run, None, adm)
        assert (stream.gate.in_flight, stream.gate.used) == (0, 0)
