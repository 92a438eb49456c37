"""Random augmentation in per-sample code (apache/mxnet#9335): each batch is made with numpy's,
``random``'s and (in worker processes) MXNet's global RNGs seeded from (seed, epoch, batch
number), so worker processes never repeat each other's draws, any number of them gives the
same batches, the loop's own thread gives the same numpy/random draws and keeps its RNG
states, epochs differ, a resumed run draws what the unbroken one drew, and a batch remade with
NDArray rows draws again what it drew. Threads are not seeded (see gluon_stream._mx.workers)."""
from __future__ import annotations

import random

import mxnet as mx
import numpy as np
import pytest

import gluon_stream as gs
from _helpers import all_ids, id_shards

pytestmark = pytest.mark.mxnet  # these tests use MXNet: warm its engine first

SIZES = [40] * 6  # 240 samples


def draw(ids, half):
    """Augmentation that draws from the three global RNGs per-sample code uses."""
    return (ids, np.float64(np.random.rand()), np.float64(random.random()),
            np.float64(mx.nd.random.uniform(shape=(1,)).asnumpy()[0]))


def draw_numpy(ids, half):
    return ids, np.float64(np.random.rand()), np.float64(random.random())


def loader(sizes=SIZES, transform=draw, **kw):
    kw.setdefault("batch_size", 8)
    kw.setdefault("shuffle", True)
    kw.setdefault("seed", 11)
    return gs.StreamLoader(gs.FunctionSource(range(len(sizes)), id_shards(sizes)),
                           sample_transform=transform, **kw)


def rows(batch):
    """A batch as (id, draws...) tuples."""
    return list(zip(*(field.asnumpy().tolist() for field in batch)))


def epoch_rows(ld, epoch):
    ld.set_epoch(epoch)
    return [rows(b) for b in ld]


def test_no_two_worker_processes_repeat_a_draw():
    with loader(num_workers=2) as ld:
        samples = [r for b in epoch_rows(ld, 0) for r in b]
    assert sorted(int(r[0]) for r in samples) == all_ids(SIZES)
    for column, rng in [(1, "numpy"), (2, "random"), (3, "mxnet")]:
        distinct = len({r[column] for r in samples})
        print(f"\n{rng}: {distinct} distinct draws of {len(samples)}")
        assert distinct == len(samples), rng  # forked RNG states gave 128 of 240


def test_the_same_seed_gives_the_same_batches_with_any_number_of_worker_processes():
    runs = {}
    for n in (1, 2, 3):
        with loader(num_workers=n) as ld:
            runs[n] = [epoch_rows(ld, 0), epoch_rows(ld, 1)]
    assert runs[1] == runs[2] == runs[3]


def test_the_loops_own_thread_draws_what_the_workers_draw_and_keeps_its_rng_states():
    with loader(transform=draw_numpy, num_workers=2) as ld:
        in_workers = epoch_rows(ld, 0)
    np.random.seed(5)
    random.seed(5)
    mx.random.seed(5)
    saved = np.random.get_state(), random.getstate()
    with loader(transform=draw_numpy, num_workers=0) as ld:
        inline = epoch_rows(ld, 0)
    after = np.random.get_state(), random.getstate()
    mx_after = mx.nd.random.uniform(shape=(3,)).asnumpy()
    mx.random.seed(5)
    assert inline == in_workers
    assert after[0][0] == saved[0][0] and np.array_equal(after[0][1], saved[0][1])
    assert after[0][2:] == saved[0][2:] and after[1] == saved[1]
    np.testing.assert_array_equal(mx_after, mx.nd.random.uniform(shape=(3,)).asnumpy())


def test_epochs_draw_anew_and_an_epoch_again_draws_the_same():
    with loader(num_workers=2) as ld:
        first, second, first_again = epoch_rows(ld, 0), epoch_rows(ld, 1), epoch_rows(ld, 0)
    assert first == first_again
    draws = [{r[1] for b in run for r in b} for run in (first, second)]
    assert not draws[0] & draws[1]


def rows_until(ld, epochs, stop=None):
    """Rows of the batches of ``epochs``, stopping after ``stop`` batches (mid-epoch)."""
    out = []
    for epoch in epochs:
        ld.set_epoch(epoch)
        for batch in ld:
            out.append(rows(batch))
            if len(out) == stop:
                return out
    return out


@pytest.mark.parametrize("cut", [1, 7, 10, 16])
def test_a_resumed_run_augments_the_rest_as_the_unbroken_run_did(cut):
    sizes = [10, 7, 12, 9]  # 10 batches an epoch, some across shard boundaries
    opts = {"sizes": sizes, "batch_size": 4, "num_workers": 2}
    with loader(**opts) as ld:
        unbroken = rows_until(ld, [0, 1])
    with loader(**opts) as ld:
        broken = rows_until(ld, [0, 1], stop=cut)
        state = ld.state_dict()
    with loader(**opts) as ld:
        ld.load_state_dict(state)
        broken += [rows(b) for b in ld]
        if len(broken) < len(unbroken):  # cut in epoch 0: then epoch 1 whole
            broken += rows_until(ld, [1])
    assert len(unbroken) == 2 * 10
    assert broken == unbroken


def images(key):
    rng = np.random.default_rng(key)
    return rng.integers(0, 255, (6, 8, 8, 3), dtype=np.uint8), np.arange(6, dtype=np.float32)


TO_TENSOR = mx.gluon.data.vision.transforms.ToTensor()


def draw_then_to_tensor(image, label):
    """Draws, then hands numpy rows to ToTensor, which rejects them: 'auto' remakes the batch
    with NDArray rows, and the remade batch must draw the numbers the first attempt drew."""
    jitter = np.float32(np.random.rand())
    return TO_TENSOR(image) + jitter, label, np.float64(jitter)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_batch_remade_with_ndarray_rows_draws_what_it_drew(num_workers):
    def run(sample_format):
        with gs.StreamLoader(gs.FunctionSource([0, 1, 2], images), batch_size=4, shuffle=True,
                             seed=3, sample_transform=draw_then_to_tensor,
                             sample_format=sample_format, num_workers=num_workers) as ld:
            return [[b[2].asnumpy().tolist(), b[0].asnumpy()] for b in ld]

    auto, ndarray = run("auto"), run("ndarray")
    assert [d for d, _ in auto] == [d for d, _ in ndarray]
    for (_, a), (_, b) in zip(auto, ndarray):
        np.testing.assert_array_equal(a, b)


def test_threads_do_not_reseed_the_global_rngs():
    """Threads share the process's RNGs: a per-batch seed would be consumed by whichever
    batches run at the same time, so none is set; draws go on from the process's state."""
    np.random.seed(5)
    with loader(transform=draw_numpy, num_workers=2, thread_pool=True) as ld:
        first, first_again = epoch_rows(ld, 0), epoch_rows(ld, 0)
    samples = [r for run in (first, first_again) for b in run for r in b]
    assert len({r[1] for r in samples}) == len(samples)  # no repeats, and not reproducible



class Jitter(mx.gluon.HybridBlock):
    """Draws from MXNet's RNG inside a cached graph (a hybridized block)."""

    def hybrid_forward(self, F, x):
        return x + F.random.uniform(shape=(1,))


def mxnet_draw(how):
    """A draw from MXNet's RNG through one way of running operators only (``nd.array`` and
    ``asnumpy`` run none), made before the workers are forked."""
    if how == "cached graph":
        block = Jitter()
        block.hybridize()
        block(mx.nd.zeros((1,)))
        return lambda: block(mx.nd.array(np.zeros(1, np.float32))).asnumpy()[0]
    if how == "executor":
        exe = mx.sym.random.uniform(shape=(1,)).bind(mx.cpu(), {})
        return lambda: exe.forward()[0].asnumpy()[0]
    return lambda: mx.nd.random.uniform(shape=(1,)).asnumpy()[0]


@pytest.mark.parametrize("how", ["cached graph", "executor", "imperative"])
def test_mxnet_draws_are_seeded_per_batch_whichever_way_operators_run(how):
    """MXNet's RNG takes the batch's seed just before the batch's first MXNet operator (lazily:
    a numpy-only batch does not pay the reseed); here a third of the samples draw from it."""
    from gluon_stream._mx import samples

    draw = mxnet_draw(how)

    def transform(ids, half):
        value = draw() if int(ids) % 3 == 0 else np.float32(-1)
        return ids, np.float64(value), np.int64(samples._LAZY[0])

    runs = {}
    for n in (1, 2):
        with loader(transform=transform, num_workers=n) as ld:
            runs[n] = [epoch_rows(ld, 0), epoch_rows(ld, 1)]
    assert runs[1] == runs[2]
    rows_ = [r for epoch in runs[2] for b in epoch for r in b]
    assert {r[2] for r in rows_} == {1}  # the lazy seeding was in place in every worker
    drawn = [r[1] for r in rows_ if r[1] != -1]
    assert len(drawn) == len(set(drawn)) == sum(1 for r in rows_ if int(r[0]) % 3 == 0)


def test_batch_seeds_are_fixed_distinct_and_in_the_range_numpy_seeds_take():
    """Each (seed, epoch, batch number) gives its own seed, the same on every call, within
    [0, 2**31) as np.random.seed takes it; negative and large seeds are folded, not refused."""
    from gluon_stream._utils.random import batch_seed
    runs = {(s, e): [batch_seed(s, e, n) for n in range(2000)]
            for s in (0, 1, -1, 2 ** 40) for e in range(3)}
    for (s, e), seeds in runs.items():
        assert all(0 <= x < 2 ** 31 for x in seeds)
        assert len(set(seeds)) == len(seeds)  # within an epoch, every batch draws anew
        assert seeds == [batch_seed(s, e, n) for n in range(2000)]
    assert len({tuple(seeds) for seeds in runs.values()}) == len(runs)
