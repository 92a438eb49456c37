"""StreamLoader: exact-once delivery across shard boundaries, last_batch modes, determinism,
prefetch overlap, lifecycle. Every sample carries a unique id (1000 * key + row)."""
from __future__ import annotations

import collections
import itertools
import os
import subprocess
import sys
import threading

import mxnet as mx
import numpy as np
import psutil
import pytest

import gluon_stream as gs
from _helpers import all_ids, batch_ids, id_shards

pytestmark = pytest.mark.mxnet  # these tests use MXNet: warm its engine first

SIZES = [7, 0, 3, 12, 5, 10]  # not multiples of 4, one empty shard, one smaller than a batch
BS = 4
DATALOADER = {"batchify_fn": mx.gluon.data.dataloader.default_batchify_fn}
PATHS = {"vectorised": {}, "dataloader": DATALOADER,
         "dataloader-2-threads": dict(DATALOADER, num_workers=2)}


def make_loader(sizes=SIZES, **kw):
    kw.setdefault("batch_size", BS)
    return gs.StreamLoader(gs.FunctionSource(range(len(sizes)), id_shards(sizes)), **kw)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shuffle", [False, True])
def test_keep_delivers_each_sample_once_and_full_batches(path, shuffle):
    with make_loader(shuffle=shuffle, seed=3, **PATHS[path]) as loader:
        batches = [batch_ids(b) for b in loader]
    ids = [i for b in batches for i in b]
    assert sorted(ids) == all_ids(SIZES)
    assert collections.Counter(ids).most_common(1)[0][1] == 1
    assert [len(b) for b in batches[:-1]] == [BS] * (len(batches) - 1)
    assert len(batches[-1]) == sum(SIZES) % BS == 1
    assert len(batches) == -(-sum(SIZES) // BS)


@pytest.mark.parametrize("path", PATHS)
def test_last_batch_modes_at_epoch_end(path):
    sizes = [5, 2, 6]  # 13 samples: three full batches of 4 and one left over
    with make_loader(sizes, last_batch="keep", **PATHS[path]) as loader:
        assert [len(batch_ids(b)) for b in loader] == [4, 4, 4, 1]
    with make_loader(sizes, last_batch="discard", **PATHS[path]) as loader:
        ids = [i for b in loader for i in batch_ids(b)]
    assert len(ids) == 12 and len(set(ids)) == 12 and set(ids) < set(all_ids(sizes))


@pytest.mark.parametrize("path", PATHS)
def test_rollover_carries_the_remainder_into_the_next_epoch_only(path):
    # keys(epoch) gives each epoch its own keys, so every id tells which epoch made it
    sizes = {k: [5, 2, 6][k % 10] for k in (0, 1, 2, 10, 11, 12, 20, 21, 22)}

    def fn(key):
        ids = np.arange(sizes[key], dtype=np.int64) + 1000 * key
        return ids, ids.astype(np.float32)

    src = gs.FunctionSource(lambda epoch: [10 * epoch, 10 * epoch + 1, 10 * epoch + 2], fn)
    with gs.StreamLoader(src, batch_size=BS, last_batch="rollover", **PATHS[path]) as loader:
        epochs = []
        for epoch in range(3):
            loader.set_epoch(epoch)
            epochs.append([batch_ids(b) for b in loader])
    for batches in epochs:
        assert all(len(b) == BS for b in batches)
    left0 = set(all_ids([5, 2, 6])) - {i for b in epochs[0] for i in b}
    assert len(left0) == 1
    assert left0 <= set(epochs[1][0])  # at the start of epoch 1 ...
    assert not left0 & {i for b in epochs[1][1:] + epochs[2] for i in b}  # ... and nowhere else
    delivered = [i for batches in epochs for b in batches for i in b]
    assert len(delivered) == len(set(delivered)) == 36  # 39 made, 3 rolled past epoch 2


def test_leftover_of_a_shard_starts_the_next_shards_first_batch():
    with make_loader([6, 6]) as loader:
        batches = [batch_ids(b) for b in loader]
    assert batches == [[0, 1, 2, 3], [4, 5, 1000, 1001], [1002, 1003, 1004, 1005]]


def test_multi_array_batches_are_lists_and_single_arrays_are_ndarrays():
    with make_loader([8]) as loader:
        data, label = next(iter(loader))
        assert isinstance(data, mx.nd.NDArray) and data.dtype == np.int64
        assert (label.asnumpy() == data.asnumpy() * 0.5).all()
    src = gs.FunctionSource([0], lambda k: np.arange(8, dtype=np.float32))
    with gs.StreamLoader(src, batch_size=4) as loader:
        batch = next(iter(loader))
        assert isinstance(batch, mx.nd.NDArray) and batch.shape == (4,)


@pytest.mark.parametrize("path", ["vectorised", "dataloader"])
def test_vectorised_and_dataloader_paths_give_identical_batches(path):
    def run(**kw):
        with make_loader(shuffle=True, seed=11, **kw) as loader:
            loader.set_epoch(2)
            return [[b.asnumpy().tolist() for b in batch] for batch in loader]
    assert run(**PATHS[path]) == run(**DATALOADER)


def test_shuffle_is_deterministic_per_seed_and_epoch():
    def order(seed, epoch):
        with make_loader(shuffle=True, seed=seed) as loader:
            loader.set_epoch(epoch)
            return [i for b in loader for i in batch_ids(b)]
    assert order(5, 0) == order(5, 0)
    assert order(5, 0) != order(5, 1)
    assert order(5, 0) != order(6, 0)
    assert sorted(order(5, 1)) == all_ids(SIZES)
    with make_loader(shuffle=False) as loader:
        assert [i for b in loader for i in batch_ids(b)] == all_ids(SIZES)


def test_without_set_epoch_each_pass_is_the_next_epoch():
    with make_loader(shuffle=True, seed=5) as loader:
        first = [i for b in loader for i in batch_ids(b)]
        second = [i for b in loader for i in batch_ids(b)]
        loader.set_epoch(1)
        again = [i for b in loader for i in batch_ids(b)]
    assert first != second and second == again


def test_after_set_epoch_the_following_passes_go_on_from_it():
    with make_loader(shuffle=True, seed=5) as loader:
        loader.set_epoch(3)
        assert loader.epoch == 3
        list(loader)
        assert loader.epoch == 4  # not epoch 3 again (Module.fit calls reset() per epoch)
        list(loader)
        assert [e.epoch for e in loader.stats.epochs] == [3, 4]


class Gate:
    """A FunctionSource fn that records when each key starts and blocks until released."""

    def __init__(self, sizes):
        self.sizes = sizes
        self.started = collections.defaultdict(threading.Event)
        self.release = collections.defaultdict(threading.Event)

    def __call__(self, key):
        self.started[key].set()
        assert self.release[key].wait(30), f"test never released key {key}"
        return id_shards(self.sizes)(key)


@pytest.mark.parametrize("prefetch", [1, 2])
def test_next_shards_are_produced_while_the_current_one_is_consumed(prefetch):
    gate = Gate([8] * 6)
    src = gs.FunctionSource(range(6), gate)
    with gs.StreamLoader(src, batch_size=BS, prefetch=prefetch, producers=3) as loader:
        it = iter(loader)
        gate.release[0].set()
        assert batch_ids(next(it))[0] == 0  # consuming shard 0 ...
        for k in range(1, prefetch + 1):  # ... while shards 1..prefetch are being produced
            assert gate.started[k].wait(10)
        assert not gate.started[prefetch + 1].is_set()  # and no more than prefetch ahead
        for k in range(6):
            gate.release[k].set()
        rest = [i for b in it for i in batch_ids(b)]
    assert len(rest) == 6 * 8 - BS


def test_endless_iterator_draws_only_what_prefetch_needs():
    drawn = []

    def keys():
        for k in itertools.count():
            drawn.append(k)
            if k == 5:
                return
            yield k

    src = gs.FunctionSource(keys(), id_shards([8] * 6))
    with gs.StreamLoader(src, batch_size=BS, prefetch=2) as loader:
        it = iter(loader)
        next(it)
        assert len(drawn) <= 3  # the current shard + 2 ahead
        with pytest.raises(TypeError, match="iterator"):
            len(loader)
        ids = [i for b in it for i in batch_ids(b)]
    assert len(ids) + BS == 5 * 8  # streamed until the iterator ended, in its order
    assert ids[-1] == 4007


def test_breaking_out_then_iterating_again_gives_a_clean_epoch():
    with make_loader(shuffle=True, seed=1) as loader:
        for _ in range(3):
            loader.set_epoch(0)
            for i, _ in enumerate(loader):
                if i == 2:
                    break
        loader.set_epoch(0)
        with pytest.raises(KeyboardInterrupt):
            for i, _ in enumerate(loader):
                if i == 4:
                    raise KeyboardInterrupt
        loader.set_epoch(0)
        ids = [i for b in loader for i in batch_ids(b)]
    assert sorted(ids) == all_ids(SIZES)


def test_len_from_file_headers_and_after_a_pass(tmp_path):
    paths = []
    for k, n in enumerate([5, 7, 9]):
        paths.append(str(tmp_path / f"s{k}.npy"))
        np.save(paths[-1], np.arange(n))
    with gs.StreamLoader(gs.FileSource(paths), batch_size=4) as loader:
        assert len(loader) == 6 == sum(1 for _ in loader)
    with gs.StreamLoader(gs.FileSource(paths), batch_size=4, last_batch="discard") as loader:
        assert len(loader) == 5 == sum(1 for _ in loader)
    with make_loader(transform=lambda raw: raw) as loader:
        with pytest.raises(TypeError, match="unknown"):
            len(loader)
        assert sum(1 for _ in loader) == len(loader) == 10


def test_closed_loader_raises_and_close_is_idempotent():
    loader = make_loader()
    next(iter(loader))
    loader.close()
    loader.close()
    with pytest.raises(gs.LoaderClosed):
        iter(loader)


def test_garbage_collection_closes_an_abandoned_loader():
    loader = make_loader(shuffle=True, seed=0)
    it = iter(loader)
    next(it)
    threads = [t for t in threading.enumerate() if t.name.startswith("gluon_stream")]
    assert threads
    del it, loader
    # the autouse leak check fails this test if the producer threads outlive the loader


@pytest.mark.parametrize("bad", [dict(batch_size=0), dict(batch_size=2.5), dict(last_batch="x"),
                                 dict(num_workers=-1), dict(prefetch=-1), dict(producers=0),
                                 dict(on_error="ignore")])
def test_bad_arguments_name_the_argument(bad):
    kw = dict(batch_size=4)
    kw.update(bad)
    with pytest.raises(ValueError, match=next(iter(bad))):
        make_loader(**kw)


GENERATOR = """\
import os, sys
import numpy as np
key, out, log = sys.argv[1], sys.argv[2], sys.argv[3]
with open(log, "a") as fp:
    fp.write(key + "\\n")
if key.startswith("bad"):
    sys.stderr.write("generator: no data for " + key + "\\n")
    sys.exit(3)
np.save(out, np.full((6, 2), int(key.split("-")[-1]), dtype=np.float32))
"""


def test_command_source_caches_and_reports_failures(tmp_path):
    script = tmp_path / "gen.py"
    script.write_text(GENERATOR)
    log = tmp_path / "runs.log"
    cache = tmp_path / "cache"
    cmd = [sys.executable, str(script), "{key}", "{path}", str(log)]
    keys = ["d-1", "d-2", "d-3"]
    for _ in range(2):
        src = gs.CommandSource(keys, cmd, cache_dir=cache, retries=0)
        with gs.StreamLoader(src, batch_size=4, prefetch=2, producers=2) as loader:
            values = sorted(int(v) for b in loader for v in b.asnumpy()[:, 0])
        assert values == [1] * 6 + [2] * 6 + [3] * 6
    assert sorted(log.read_text().split()) == keys  # the second pass hit the cache
    assert sorted(os.listdir(cache)) == ["d-1.npy", "d-2.npy", "d-3.npy"]  # no temp or lock files

    src = gs.CommandSource(["d-1", "bad-2"], cmd, cache_dir=cache, retries=1, backoff=0.01)
    # num_epochs=1: no next epoch is begun early, whose generation ahead would run bad-2's
    # command again (its failure is not cached): 4 runs in the log, on a busy machine
    with gs.StreamLoader(src, batch_size=4, num_epochs=1) as loader:
        it = iter(loader)
        assert len(next(it)) == 4  # shard d-1 is delivered before the failure surfaces
        with pytest.raises(gs.ShardError) as info:
            list(it)
    err = info.value
    assert err.key == "bad-2" and err.returncode == 3 and err.argv[1] == str(script)
    assert "no data for bad-2" in err.stderr_tail and "bad-2" in str(err)
    assert log.read_text().split().count("bad-2") == 2  # one retry
    assert not [f for f in os.listdir(cache) if f.startswith(".")]


def test_epoch_in_command_caches_per_key_and_epoch(tmp_path):
    script = tmp_path / "gen.py"
    script.write_text("import sys, numpy as np\n"
                      "np.save(sys.argv[2], np.full((4,), int(sys.argv[3]), dtype=np.int64))\n")
    cmd = [sys.executable, str(script), "{key}", "{path}", "{epoch}"]
    src = gs.CommandSource(lambda epoch: ["a", "b"], cmd, cache_dir=tmp_path / "c")
    # num_epochs: no epoch 2 made ahead of time (it would add a@e2.npy, racing the listing)
    with gs.StreamLoader(src, batch_size=8, num_epochs=2) as loader:
        seen = []
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            seen.append(sorted(set(int(v) for b in loader for v in b.asnumpy())))
    assert seen == [[0], [1]]
    assert sorted(os.listdir(tmp_path / "c")) == ["a@e0.npy", "a@e1.npy", "b@e0.npy", "b@e1.npy"]


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_no_more_than_prefetch_plus_one_shards_are_held(prefetch):
    import weakref
    alive = set()
    peak = []

    def fn(key):
        arr = np.arange(40, dtype=np.int64) + 1000 * key
        alive.add(key)
        weakref.finalize(arr, alive.discard, key)
        return arr

    src = gs.FunctionSource(range(8), fn)
    with gs.StreamLoader(src, batch_size=8, prefetch=prefetch, producers=4, **DATALOADER) as ld:
        for _ in ld:
            peak.append(len(alive))
    assert max(peak) <= prefetch + 1
    assert len(peak) == 40


def test_next_epochs_first_shards_are_produced_while_this_epoch_ends():
    gate = Gate({k: 8 for k in range(80)})
    for k in range(80):  # epochs 0, 1, 5 and the ones started ahead (2, 6)
        gate.release[k].set()
    gate.release[10].clear()  # epoch 1's first shard (keys 10..12)
    src = gs.FunctionSource(lambda epoch: [10 * epoch + i for i in range(3)],
                            lambda k: id_shards(gate.sizes)(k) if gate(k) is not None else None)
    with gs.StreamLoader(src, batch_size=BS, prefetch=2) as loader:
        loader.set_epoch(0)
        it = iter(loader)
        first = [batch_ids(next(it)) for _ in range(3)]  # now on shard 1, shard 2 is ahead
        assert gate.started[10].wait(10)  # epoch 1 began while epoch 0 was still being consumed
        assert not gate.started[11].is_set()  # within the same window of prefetch shards
        first += [batch_ids(b) for b in it]
        gate.release[10].set()
        loader.set_epoch(1)
        second = [i for b in loader for i in batch_ids(b)]
        loader.set_epoch(5)  # not the epoch produced ahead (2): that work is dropped
        fifth = [i for b in loader for i in batch_ids(b)]
    assert sorted(i for b in first for i in b) == all_ids([8] * 3)
    assert sorted(second) == [1000 * k + i for k in (10, 11, 12) for i in range(8)]
    assert sorted(fifth) == [1000 * k + i for k in (50, 51, 52) for i in range(8)]


def test_close_does_not_wait_forever_for_a_stuck_python_fn(caplog):
    gate = Gate([4, 4])
    gate.release[0].set()
    loader = gs.StreamLoader(gs.FunctionSource(range(2), gate), batch_size=BS, prefetch=1)
    it = iter(loader)
    next(it)
    assert gate.started[1].wait(10)
    with caplog.at_level("WARNING", logger="gluon_stream"):
        loader.close()  # returns although fn(1) is still blocked
    assert not gate.release[1].is_set()
    assert "still running" in caplog.text
    gate.release[1].set()  # let the thread finish so the leak check sees it gone


@pytest.mark.parametrize("path", ["vectorised", "dataloader"])
def test_samples_carried_from_earlier_shards_come_before_a_shard_error(path):
    def fn(key):
        if key == 2:
            raise RuntimeError("no data for shard 2")
        return id_shards([6, 1, 4])(key)

    with gs.StreamLoader(gs.FunctionSource(range(3), fn), batch_size=4, **PATHS[path]) as ld:
        ids = []
        with pytest.raises(gs.ShardError, match="no data for shard 2"):
            for batch in ld:
                ids.append(batch_ids(batch))
    assert ids == [[0, 1, 2, 3], [4, 5, 1000]]  # the carried 3 samples as a short batch


def test_retry_policy_does_not_retry_what_cannot_succeed():
    calls = collections.Counter()

    def fn(key):
        calls[key] += 1
        return np.zeros((4, 3 if key == 1 else 2), np.float32)  # shard 1 has another shape

    src = gs.FunctionSource(lambda epoch: [10 * epoch, 10 * epoch + 1], fn)  # own keys per epoch
    with gs.StreamLoader(src, batch_size=4, on_error=("retry", 3)) as loader:
        with pytest.raises(gs.SchemaMismatch, match="shard 1"):
            list(loader)
    assert calls[1] == 1


@pytest.mark.parametrize("path", ["vectorised", "dataloader"])
def test_pin_memory_puts_batches_in_pinned_host_memory(path):
    # on the CPU build of MXNet cpu_pinned is plain host memory, but the context is the same one
    # the GPU build (mxnet-cu112) copies from without staging
    with make_loader([6, 6], pin_memory=True, **PATHS[path]) as loader:
        batches = list(loader)
    assert {str(a.context) for b in batches for a in b} == {"cpu_pinned(0)"}
    assert sorted(i for b in batches for i in batch_ids(b)) == all_ids([6, 6])


# -- len() before the first pass ------------------------------------------------------------
@pytest.mark.parametrize("shard_sizes", [dict(enumerate([5, 5, 5])), lambda key: 5, 5])
def test_len_before_the_first_pass_from_shard_sizes(shard_sizes):
    """LR schedulers and GluonCV's scripts ask for len() before training starts."""
    src = gs.FunctionSource(range(3), lambda k: np.zeros((5, 2)))
    with gs.StreamLoader(src, batch_size=4, transform=lambda raw: raw,
                         shard_sizes=shard_sizes) as loader:
        assert len(loader) == 4
        assert sum(1 for _ in loader) == 4


def test_len_of_a_fresh_function_source_says_why_and_what_works():
    src = gs.FunctionSource(range(3), lambda k: np.zeros((5, 2)))
    with gs.StreamLoader(src, batch_size=4) as loader:
        with pytest.raises(TypeError) as info:
            len(loader)
        message = str(info.value)
        assert "3 of 3 shards" in message and "not cached" in message
        assert "transform" not in message.split("(")[1].split(")")[0]  # there is none
        for fix in ("shard_sizes=", "gluon-stream generate", "FileSource"):
            assert fix in message
        assert sum(1 for _ in loader) == 4
        assert len(loader) == 4  # sizes seen in a pass are reused: the data cannot change


def test_len_of_a_command_source_reads_cached_headers_and_explains_epoch(tmp_path):
    script = tmp_path / "gen.py"
    script.write_text("import sys, numpy as np\nnp.save(sys.argv[1], np.zeros((6, 2)))\n")
    cmd = [sys.executable, str(script), "{path}"]
    with gs.StreamLoader(gs.CommandSource(["a", "b"], cmd, cache_dir=tmp_path / "c"),
                         batch_size=4) as loader:
        with pytest.raises(TypeError, match="not in the cache yet"):
            len(loader)
        list(loader)
    with gs.StreamLoader(gs.CommandSource(["a", "b"], cmd, cache_dir=tmp_path / "c"),
                         batch_size=4) as loader:
        assert len(loader) == 3  # a new loader: from the cached files' headers, no generation
    per_epoch = gs.CommandSource(["a"], cmd + ["{epoch}"], cache_dir=tmp_path / "e")
    with gs.StreamLoader(per_epoch, batch_size=4) as loader:
        with pytest.raises(TypeError, match=r"\{epoch\}, so every epoch has new shards"):
            len(loader)


# -- bool arrays ----------------------------------------------------------------------------
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("last_batch", ["keep", "rollover"])
def test_bool_masks_cross_shard_boundaries_and_roll_over(path, last_batch):
    def fn(key):
        ids = np.arange(5) + 1000 * key
        return ids, ids % 3 == 0

    src = gs.FunctionSource(range(3), fn)
    with gs.StreamLoader(src, batch_size=4, last_batch=last_batch, **PATHS[path]) as loader:
        batches = []
        for epoch in range(2):
            loader.set_epoch(epoch)
            batches += [(b[0].asnumpy(), b[1].asnumpy()) for b in loader]
    for ids, mask in batches:
        assert mask.dtype == np.bool_
        np.testing.assert_array_equal(mask, ids % 3 == 0)  # every batch, joined ones too


# -- an epoch with no samples ---------------------------------------------------------------
@pytest.mark.parametrize("case, kwargs, reason", [
    ("no keys", dict(keys=[]), "it has no keys"),
    ("empty shards", dict(sizes=[0, 0]), "hold no samples"),
    ("too few", dict(sizes=[1, 2], last_batch="discard"),
     "3 samples are fewer than batch_size=4 and last_batch='discard' keeps them out"),
    ("too few, even", dict(sizes=[1, 2], even_batches=True),
     "3 samples are fewer than batch_size=4 and even_batches=True keeps them out"),
    ("all skipped", dict(sizes=[5, 5], fail=True, on_error="skip"), "all 2 shards were skipped"),
])
def test_an_epoch_without_samples_warns_once_saying_why(case, kwargs, reason, caplog):
    sizes = kwargs.pop("sizes", [3])
    keys = kwargs.pop("keys", range(len(sizes)))
    fail = kwargs.pop("fail", False)

    def fn(key):
        if fail:
            raise RuntimeError("no data")
        return id_shards(sizes)(key)

    with caplog.at_level("WARNING", logger="gluon_stream"):
        with gs.StreamLoader(gs.FunctionSource(keys, fn), batch_size=4, **kwargs) as loader:
            assert list(loader) == []
    empty = [r for r in caplog.records if "delivered no samples" in r.getMessage()]
    assert len(empty) == 1 and reason in empty[0].getMessage(), caplog.text


# -- fork and interpreter exit --------------------------------------------------------------
def test_a_loader_used_in_a_forked_child_raises_instead_of_hanging():
    with make_loader([8, 8]) as loader:
        assert batch_ids(next(iter(loader))) == [0, 1, 2, 3]
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: its copy of the loader has none of the parent's threads
            code = 3
            try:
                iter(loader)
            except gs.LoaderClosed as exc:
                code = 0 if "is a fork of it" in str(exc) else 4
            os.write(write, b"x")
            os._exit(code)
        os.close(write)
        os.read(read, 1)
        os.close(read)
        _, status = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(status) == 0
        assert sorted(i for b in loader for i in batch_ids(b)) == all_ids([8, 8])  # parent: fine


EXIT_SCRIPT = """
import os, sys, time
sys.path.insert(0, {tests!r})
import gluon_stream as gs
from fake_generator import command, read_lines
src = gs.CommandSource(["k0", "k1", "k2"], command("ok", workdir={work!r}, modes={{"k1": "hang",
                       "k2": "hang"}}), cache_dir={cache!r}, timeout=60, retries=0)
loader = gs.StreamLoader(src, batch_size=4, prefetch=2, producers=2)
it = iter(loader)
next(it)  # k0 is in; k1 and k2 are being generated (they would run 60 s)
deadline = time.monotonic() + 20
while not {{"k1", "k2"}} <= set(read_lines(os.path.join({work!r}, "started"))):
    assert time.monotonic() < deadline, "the generators never started"
    time.sleep(0.01)
print("started", flush=True)
raise SystemExit(0)  # no close(), no with: a script that stops (or crashes) here
"""


@pytest.mark.timeout(60)
def test_an_unclosed_loader_does_not_hold_up_the_interpreters_exit(tmp_path):
    from fake_generator import read_lines

    code = EXIT_SCRIPT.format(tests=os.path.dirname(__file__), work=str(tmp_path),
                              cache=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=30)  # the hanging generators would hold it 60 s
    assert proc.returncode == 0 and "started" in proc.stdout, proc.stderr
    pids = [int(p) for p in read_lines(tmp_path / "pids")]
    assert len(pids) == 3
    for pid in pids:  # the generators were killed on the way out, not left running
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not [f for f in os.listdir(tmp_path / "cache") if f.startswith(".")]


def test_a_dtype_mxnet_cannot_batch_is_a_typed_error_naming_the_shard():
    def fn(key):
        return np.zeros((4, 2), np.float32), np.arange(4).astype("datetime64[D]")

    with gs.StreamLoader(gs.FunctionSource(["2024-01-02"], fn), batch_size=2) as loader:
        with pytest.raises(gs.UnbatchableShard, match=r"shard '2024-01-02' .*array 1 has dtype "
                                                      r"datetime64\[D\].*astype"):
            list(loader)
    converted = gs.FunctionSource(["2024-01-02"], fn)
    with gs.StreamLoader(converted, batch_size=2,
                         transform=lambda raw: (raw[0], raw[1].astype("int64"))) as loader:
        assert [b[1].dtype for b in loader] == [np.int64, np.int64]
