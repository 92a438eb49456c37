"""A loader that nothing but its loop refers to: ``for b in StreamLoader(...)`` and
``next(iter(StreamLoader(...)))`` keep working while the iterator lives (MXNet's
``test_gluon_data.py::test_dataloader_scope`` checks the same of ``gluon.data.DataLoader``), on
every batch path, and everything is released once the loader and its iterators are both gone:
no ``with``, no ``close()``, garbage collection only."""
from __future__ import annotations

import gc

import mxnet as mx
import psutil
import pytest

import gluon_stream as gs
from _helpers import dead, id_shards, leaks, snapshot, wait_for
from fake_generator import command, read_lines

pytestmark = pytest.mark.mxnet

SIZES = [9, 4, 11, 7, 7]  # 38: the last batch (2) splits over two contexts
BATCHIFY = {"batchify_fn": mx.gluon.data.dataloader.default_batchify_fn}
PATHS = {
    "slices": {},
    "inline": dict(BATCHIFY),
    "threads": dict(BATCHIFY, num_workers=2, thread_pool=True),
    "processes": dict(BATCHIFY, num_workers=1),  # MXNet's test_dataloader_scope
    "sample_transform": {"sample_transform": lambda ids, half: (ids, half), "num_workers": 2},
    "ctx": {"ctx": mx.cpu(0)},
    "ctx_list": {"ctx": [mx.cpu(0), mx.cpu(1)]},
    "shards_on_ctx": {"ctx": mx.cpu(0), "shards_on_ctx": True},
    "shuffle_window": {"shuffle": True, "seed": 3, "shuffle_window": 2},
    "samples_per_epoch": {"samples_per_epoch": 20, "shuffle": True, "seed": 5},
    "even_pad": {"even_batches": "pad", "num_parts": 2, "part_index": 1},
}


def source():
    return gs.FunctionSource(range(len(SIZES)), id_shards(SIZES))


def ids(batch) -> list:
    """The ids of a batch, whichever form it arrives in (one array per ctx with a ctx list)."""
    first = batch[0] if isinstance(batch, (list, tuple)) else batch
    parts = first if isinstance(first, (list, tuple)) else [first]
    return [int(x) for part in parts for x in part.asnumpy()]


def named_run(kw) -> list:
    with gs.StreamLoader(source(), batch_size=4, **kw) as loader:
        return [ids(b) for b in loader]


@pytest.mark.parametrize("path", PATHS)
def test_a_loader_only_its_for_loop_refers_to_yields_every_batch(path):
    expected = named_run(PATHS[path])
    assert len(expected) >= 4
    got = []
    for batch in gs.StreamLoader(source(), batch_size=4, **PATHS[path]):
        gc.collect()  # nothing else holds the loader: its iterator must
        got.append(ids(batch))
    assert got == expected


@pytest.mark.parametrize("path", PATHS)
def test_next_iter_of_an_unreferenced_loader_is_its_first_batch(path):
    expected = named_run(PATHS[path])[0]
    batch = next(iter(gs.StreamLoader(source(), batch_size=4, **PATHS[path])))
    gc.collect()  # the loader and its iterator are gone now: the batch is the loop's to keep
    assert ids(batch) == expected


@pytest.mark.parametrize("path", PATHS)
def test_an_iterator_abandoned_mid_epoch_then_dropped_releases_everything(path):
    before = snapshot()
    src = source()
    it = iter(gs.StreamLoader(src, batch_size=4, prefetch=2, **PATHS[path]))
    first = [ids(next(it)) for _ in range(2)]
    gc.collect()
    assert first == named_run(PATHS[path])[:2]  # still open after a collection
    if path in ("processes", "sample_transform"):
        assert psutil.Process().children(), "the worker processes should be running"
    del it
    gc.collect()
    with pytest.raises(gs.LoaderClosed):  # the loader closed what it owned, its source too
        src.produce(0, 0)
    assert not leaks(before)


def test_a_dropped_iterator_kills_the_generator_it_was_waiting_on(tmp_path):
    src = gs.CommandSource(["k0", "k1"], command("ok", workdir=tmp_path, modes={"k1": "hang"},
                                                 rows=8),
                           cache_dir=tmp_path / "cache", timeout=60, retries=0)
    it = iter(gs.StreamLoader(src, batch_size=4, prefetch=1))
    assert next(it).shape == (4, 3)
    wait_for(lambda: len(read_lines(tmp_path / "started")) == 2, 30, "k1's generator")
    del it
    gc.collect()
    for pid in map(int, read_lines(tmp_path / "pids")):
        wait_for(lambda pid=pid: dead(pid), 5, f"generator pid {pid} to die")
    assert [p for p in (tmp_path / "cache").iterdir() if p.name.startswith("k1")] == []


def test_a_stream_iter_over_an_unreferenced_loader_runs_epochs_then_releases_everything():
    def batches(it, epochs):
        out = []
        for _ in range(epochs):
            it.reset()
            out.append([[int(x) for x in b.data[0].asnumpy()] for b in it])
        return out

    with gs.StreamLoader(source(), batch_size=4, shuffle=True, seed=2, **BATCHIFY,
                         num_workers=1) as named:
        expected = batches(gs.StreamIter(named, label_names=("half",)), 2)
    before = snapshot()
    src = source()
    it = gs.StreamIter(gs.StreamLoader(src, batch_size=4, shuffle=True, seed=2, **BATCHIFY,
                                       num_workers=1), label_names=("half",))
    gc.collect()
    assert batches(it, 2) == expected and expected[0] != expected[1]
    del it
    gc.collect()
    with pytest.raises(gs.LoaderClosed):
        src.produce(0, 0)
    assert not leaks(before)


def test_a_named_loader_outlives_the_iterators_it_gave():
    """The iterator keeps its loader; it does not close a loader the user still holds."""
    loader = gs.StreamLoader(source(), batch_size=4, **BATCHIFY, num_workers=1)
    it = iter(loader)
    next(it)
    del it
    gc.collect()
    assert [ids(b) for b in loader] == named_run(dict(BATCHIFY, num_workers=1))
    loader.close()
