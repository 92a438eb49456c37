"""Per-sample work on workers: the persistent process pool (forked once, fed through shared
memory, exactly-once after a death, nothing left behind), threads and the loop's own thread
giving the same batches, errors keeping their type, and what per-sample code receives."""
from __future__ import annotations

import collections
import os
import signal
import threading
import time

import mxnet as mx
import numpy as np
import psutil
import pytest

import gluon_stream as gs
from _helpers import JOIN_S, all_ids, batch_ids, id_shards, made_here, shm_entries
from gluon_stream._mx import shm as shm_mod
from gluon_stream._mx import workers as workers_mod

pytestmark = pytest.mark.mxnet  # these tests use MXNet: warm its engine first

SIZES = [9, 4, 11, 0, 7]
MODES = {"inline": {"num_workers": 0}, "threads": {"num_workers": 2, "thread_pool": True},
         "processes": {"num_workers": 2}}


def with_pid(ids, half):
    """A per-sample transform that tells which process made the sample."""
    return ids, half, np.int64(os.getpid())


def loader(sizes=SIZES, **kw):
    kw.setdefault("batch_size", 4)
    return gs.StreamLoader(gs.FunctionSource(range(len(sizes)), id_shards(sizes)), **kw)


def epochs(n, **kw):
    with loader(shuffle=True, seed=4, **kw) as ld:
        out = []
        for epoch in range(n):
            ld.set_epoch(epoch)
            out.append([[a.asnumpy().tolist() for a in b[:2]] for b in ld])
        return out


@pytest.mark.parametrize("mode", MODES)
def test_every_worker_mode_gives_the_slice_paths_batches(mode):
    reference = epochs(2)  # no per-sample work: slices of the shuffled shards
    same = epochs(2, sample_transform=lambda ids, half: (ids, half), **MODES[mode])
    assert same == reference
    assert reference[0] != reference[1]
    flat = [i for batch in reference[0] for i in batch[0]]
    assert sorted(flat) == all_ids(SIZES) and len(flat) == len(set(flat))


def test_the_process_pool_is_forked_once_and_kept_across_shards_and_epochs():
    with loader(sizes=[12] * 6, sample_transform=with_pid, num_workers=2) as ld:
        workers = ld._path.workers
        pids = set(workers.pids)
        assert workers.forks == 2 and len(pids) == 2 and os.getpid() not in pids
        made_by = set()
        for epoch in range(3):
            ld.set_epoch(epoch)
            for batch in ld:
                made_by.update(int(p) for p in batch[2].asnumpy())
        assert workers.forks == 2  # no fork per shard, none per epoch
        assert made_by == pids  # every batch made in one of the two first workers
        assert pids <= {c.pid for c in psutil.Process().children()}  # still alive, not re-forked


def memory_files() -> list[str]:
    """This process's open anonymous memory files made by gluon_stream."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "memfd:gluon_stream" in os.readlink(f"/proc/self/fd/{fd}"):
                out.append(fd)
        except FileNotFoundError:  # the fd listing itself, closed meanwhile
            continue
    return out


def test_shards_reach_the_workers_through_shared_memory_not_files():
    before = shm_entries()
    with loader(sample_transform=with_pid, num_workers=2) as ld:
        ids = [i for b in ld for i in batch_ids(b)]
        deadline = time.monotonic() + JOIN_S  # the next epoch's first shards, made ahead, wait
        while not memory_files() and time.monotonic() < deadline:  # there once their
            time.sleep(0.01)  # producer (a background thread) has copied them
        assert memory_files()
        assert not made_here(shm_entries() - before)  # nothing named, nothing to leave behind
    assert sorted(ids) == all_ids(SIZES)
    assert not memory_files()


class LabelError(KeyError):
    """A user's own error type: it must come back from the worker unchanged."""


def fail_on(bad_id):
    def transform(ids, half):
        if int(ids) == bad_id:
            raise LabelError(f"no label for sample {int(ids)}")
        return ids, half
    return transform


@pytest.mark.parametrize("mode", MODES)
def test_an_error_in_per_sample_code_keeps_its_type_and_names_the_batch(mode):
    with loader(sample_transform=fail_on(2003), **MODES[mode]) as ld:
        ids = []
        with pytest.raises(LabelError, match="no label for sample 2003") as info:
            for b in ld:
                ids.extend(batch_ids(b))
    assert ids == list(range(9)) + [1000, 1001, 1002, 1003, 2000, 2001, 2002]  # all before it
    notes = " ".join(getattr(info.value, "__notes__", []))
    if mode == "processes":
        assert "raised in worker process" in notes and "of shard 2" in notes
        assert "Traceback" in notes and "in transform" in notes  # the worker's own traceback


@pytest.mark.timeout(60)
def test_after_a_batch_timeout_the_stuck_worker_is_replaced_and_the_next_epoch_works(tmp_path):
    marker = tmp_path / "stuck-once"

    def stuck_once(ids, half):
        if int(ids) == 1002 and not marker.exists():
            marker.touch()  # any worker, in any process: only the first time
            time.sleep(30)  # stuck in user code: only killing the worker ends it
        return ids, half

    with loader(sample_transform=stuck_once, num_workers=2, timeout=1) as ld:
        with pytest.raises(gs.BatchTimeout, match=r"batch 1 of 1 of shard 1 took longer than "
                                                  r"timeout=1 s"):
            list(ld)
        ids = [i for b in ld for i in batch_ids(b)]
        forks = ld._path.workers.forks
    assert forks == 3  # the stuck worker was killed and replaced once
    assert sorted(ids) == all_ids(SIZES)


@pytest.mark.timeout(60)
def test_ctrl_c_while_waiting_for_a_worker_batch_stops_at_once_and_the_pool_survives(sigint,
                                                                                     tmp_path):
    """Ctrl-C is sent every 0.1 s until the loop stops: Python itself swallows an interrupt that
    lands inside a destructor (a batch's NDArray.__del__), which no library can prevent. The
    samples are slow until the interrupt is over, then the same workers read the rest at once."""
    interrupted = tmp_path / "interrupted"

    def slow(ids, half):
        if not interrupted.exists():  # seen by the workers (other processes)
            time.sleep(0.05)
        return ids, half

    stop = threading.Event()

    def interrupt_until_stopped():
        while not stop.wait(0.1):
            os.kill(os.getpid(), signal.SIGINT)

    with loader(sizes=[400], sample_transform=slow, num_workers=2) as ld:
        it = iter(ld)
        next(it)
        pids = set(ld._path.workers.pids)
        interrupter = threading.Thread(target=interrupt_until_stopped,
                                       name="gluon_stream-test-interrupter")
        start = time.monotonic()
        interrupter.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                for _ in it:
                    pass
        finally:
            stop.set()
            interrupter.join(JOIN_S)
        elapsed = time.monotonic() - start
        interrupted.touch()
        del it
        assert elapsed < 5.0  # 400 samples take 10 s: it stopped long before
        assert set(ld._path.workers.pids) == pids  # workers ignore SIGINT: still the same
        ids = [i for b in ld for i in batch_ids(b)]
    assert sorted(ids) == list(range(400))


def test_a_killed_worker_without_retry_is_a_clear_error_and_the_pool_is_whole_again():
    def slow(ids, half):
        time.sleep(0.003)
        return ids, half

    with loader(sizes=[300], sample_transform=slow, num_workers=2) as ld:
        it = iter(ld)
        next(it)
        victim = ld._path.workers.pids[0]
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(gs.WorkerDied, match=rf"worker process {victim} was killed by "
                                                r"SIGKILL") as info:
            for _ in it:
                pass
        del it
        assert info.value.pid == victim and info.value.key == 0
        ids = [i for b in ld for i in batch_ids(b)]  # the next pass has two workers again
        assert len(ld._path.workers.pids) == 2 and victim not in ld._path.workers.pids
    assert sorted(ids) == list(range(300))


def test_threads_make_the_first_batch_alone():
    """Gluon's hybrid blocks build their cache on the first call, which is not thread-safe."""
    active, peak, first = [0], [], threading.Event()
    lock = threading.Lock()

    def tracked(ids, half):
        with lock:
            active[0] += 1
            peak.append((first.is_set(), active[0]))
        time.sleep(0.002)
        with lock:
            active[0] -= 1
        return ids, half

    def batchify(samples):
        first.set()
        return mx.gluon.data.dataloader.default_batchify_fn(samples)

    with loader(sizes=[64], batch_size=8, sample_transform=tracked, batchify_fn=batchify,
                num_workers=4, thread_pool=True) as ld:
        assert sum(1 for _ in ld) == 8
    assert max(n for after_first, n in peak if not after_first) == 1


# -- what per-sample code receives ------------------------------------------------------------
def images(key):
    rng = np.random.default_rng(key)
    return rng.integers(0, 255, (6, 8, 8, 3), dtype=np.uint8), np.arange(6, dtype=np.float32)


TO_TENSOR = mx.gluon.data.vision.transforms.Compose([
    mx.gluon.data.vision.transforms.ToTensor(),
    mx.gluon.data.vision.transforms.Normalize(0.5, 0.25)])


def expected_tensors(key):
    image, label = images(key)
    return [TO_TENSOR(mx.nd.array(im, dtype="uint8")).asnumpy() for im in image], label


@pytest.mark.parametrize("mode", MODES)
def test_gluon_transforms_work_unchanged_on_numpy_shards(mode, caplog):
    """ToTensor/Normalize are blocks that need NDArrays: 'auto' gives them NDArrays."""
    def transform(image, label):
        return TO_TENSOR(image), label

    with caplog.at_level("INFO", logger="gluon_stream"):
        with gs.StreamLoader(gs.FunctionSource([0, 1], images), batch_size=4,
                             sample_transform=transform, **MODES[mode]) as ld:
            batches = [(d.asnumpy(), lb.asnumpy()) for d, lb in ld]
    want = [expected_tensors(0), expected_tensors(1)]
    data = np.concatenate([d for d, _ in batches])
    np.testing.assert_allclose(data, np.stack(want[0][0] + want[1][0]), rtol=1e-6)
    assert data.shape == (12, 3, 8, 8) and data.dtype == np.float32
    if mode != "processes":  # (in workers the switch is logged in the worker)
        assert "per-sample code gets NDArrays" in caplog.text


def test_numpy_code_gets_numpy_rows_and_the_format_can_be_forced():
    seen = collections.Counter()

    def record(image, label):
        seen[type(image).__name__] += 1
        return image.astype(np.float32) / 255, label

    def src():
        return gs.FunctionSource([0], images)

    with gs.StreamLoader(src(), batch_size=3, sample_transform=record) as ld:
        list(ld)
    with gs.StreamLoader(src(), batch_size=3, sample_transform=record,
                         sample_format="ndarray") as ld:
        list(ld)
    assert seen == {"ndarray": 6, "NDArray": 6}
    with gs.StreamLoader(src(), batch_size=3, sample_format="numpy",
                         sample_transform=lambda im, lb: (TO_TENSOR(im), lb)) as ld:
        with pytest.raises(ValueError, match="NDArray"):  # forced: MXNet's own refusal
            list(ld)
    with pytest.raises(ValueError, match="sample_format must be one of"):
        gs.StreamLoader(src(), batch_size=3, sample_format="tensor")


def test_a_user_error_is_not_taken_for_a_numpy_rejection():
    calls = collections.Counter()

    def buggy(image, label):
        calls["n"] += 1
        raise TypeError("my own bug")

    with gs.StreamLoader(gs.FunctionSource([0], images), batch_size=3,
                         sample_transform=buggy) as ld:
        with pytest.raises(TypeError, match="my own bug"):
            list(ld)
    assert calls["n"] == 1  # raised in the user's frame: not retried with NDArrays


def test_batchify_outputs_of_any_shape_come_back_from_worker_processes():
    def as_dict(samples):
        ids = np.array([s[0] for s in samples])
        return {"ids": mx.nd.array(ids, dtype="int64"), "count": len(samples),
                "time_major": np.tile(ids, (3, 1)), "big": np.zeros((len(samples), 20000))}

    with loader(sizes=[5, 6], batchify_fn=as_dict, num_workers=2) as ld:
        batches = list(ld)
        stats = ld.stats.epochs[-1]
    ids = [int(i) for b in batches for i in b["ids"].asnumpy()]
    assert sorted(ids) == all_ids([5, 6])
    assert [b["count"] for b in batches] == [4, 4, 3]
    assert batches[0]["time_major"].shape == (3, 4) and batches[0]["big"].shape == (4, 20000)
    assert stats.samples == 11 and stats.batches == 3  # counted by the plan, not the batch


# -- batches in the workers' slots --------------------------------------------------------------
def test_a_batch_the_loop_still_holds_is_never_overwritten_and_slots_are_reused():
    """Batches come back in shared-memory slots that the workers reuse once the loop dropped
    the batch: a batch (or a slice of one) still referenced keeps its slot, whatever comes
    after; dropped ones are recycled, so the slots stay few over many batches."""
    with loader(sizes=[200] * 4, sample_transform=lambda ids, half: (ids, half),
                num_workers=2) as ld:
        workers = ld._path.workers
        held, sliced, seen = [], [], []
        for i, (ids, half) in enumerate(ld):
            seen.append(ids.asnumpy().tolist())
            if i % 20 == 0:
                held.append((ids, seen[-1]))  # the batch itself
            elif i % 20 == 10:
                sliced.append((half[1:3], half.asnumpy()[1:3].tolist()))  # only a slice of it
        mapped = len(workers._slots._maps)
    assert sorted(i for b in seen for i in b) == all_ids([200] * 4)
    assert all(ids.asnumpy().tolist() == want for ids, want in held)
    assert all(part.asnumpy().tolist() == want for part, want in sliced)
    # 200 batches: each worker's slots are its batches in flight, a few free ones, and the
    # ones held above (10 batches, 10 slices)
    assert mapped <= 2 * (workers_mod.PER_WORKER + shm_mod.KEEP_FREE + 2) + len(held) + len(sliced)


def test_slots_are_unmapped_once_the_loader_is_closed_and_its_batches_are_gone():
    with loader(sample_transform=lambda ids, half: (ids, half), num_workers=2) as ld:
        batches = list(ld)
        mapped = dict(ld._path.workers._slots._maps)
    assert mapped and all(b[0].shape[0] for b in batches)
    unmapped = [m.unmap for m in mapped.values()]
    del mapped
    assert all(u.alive for u in unmapped)  # the batches still hold their slots
    del batches
    assert all(not u.alive for u in unmapped)


def _ids(samples):
    return np.array([s[0] for s in samples])


BATCHIFIES = {  # batchify_fn -> what the batch must look like
    "one NDArray": (lambda s: mx.nd.array(_ids(s), dtype="int64"), mx.nd.NDArray),
    "a tuple": (lambda s: (mx.nd.array(_ids(s), dtype="int64"), np.zeros((len(s), 20000))),
                tuple),
    "a list with a number": (lambda s: [mx.nd.array(_ids(s), dtype="int64"), len(s)], list),
    "a bool mask": (lambda s: [mx.nd.array(_ids(s), dtype="int64"), _ids(s) % 2 == 0], list),
}


@pytest.mark.parametrize("name", BATCHIFIES)
def test_batches_keep_their_structure_and_types_through_the_slots(name):
    batchify, kind = BATCHIFIES[name]
    with loader(sizes=[5, 6], batchify_fn=batchify, num_workers=2) as ld:
        batches = list(ld)
    assert all(type(b) is kind for b in batches)
    first = [b if kind is mx.nd.NDArray else b[0] for b in batches]
    assert sorted(int(i) for b in first for i in b.asnumpy()) == all_ids([5, 6])
    if name == "a tuple":
        assert all(type(b[1]) is np.ndarray and b[1].shape == (b[0].shape[0], 20000)
                   for b in batches)
    if name == "a bool mask":
        assert all(b[1].dtype == np.bool_ and list(b[1]) == [i % 2 == 0 for i in
                                                           b[0].asnumpy()] for b in batches)


def varied(ids, half):
    """Fields of every kind per-sample code returns: numpy rows and scalars, Python numbers."""
    return (ids, float(half), int(ids) % 7, np.full((2, 3), ids, np.float16),
            np.full(4, ids % 256, np.uint8), np.float32(half))


def test_workers_batchify_as_gluons_default_does_inline():
    """In a worker the default batchify stacks straight into the slot: same values, dtypes
    and shapes as Gluon's default_batchify_fn in the loop's own thread."""
    def run(num_workers):
        with loader(sample_transform=varied, num_workers=num_workers) as ld:
            return [[(a.dtype, a.shape, a.asnumpy().tolist()) for a in b] for b in ld]

    inline, in_workers = run(0), run(2)
    assert in_workers == inline
    assert [d for d, _, _ in inline[0]] == [np.int64, np.float64, np.int64, np.float16, np.uint8,
                                            np.float32]
