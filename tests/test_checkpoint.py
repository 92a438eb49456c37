"""The loader's position in MXNet's checkpoints: an interrupted, resumed run trains on exactly
the batches of an uninterrupted one (Estimator with StreamCheckpoint, Module with do_checkpoint).

A run is interrupted by raising from a batch-end handler after k batches (a preemption), or by
training fewer epochs or batches; it resumes in a fresh Estimator or Module with a fresh loader.
The batches the resumed run trains on are those after the newest checkpoint, so the expected
sequence is: the first run's batches up to that checkpoint, then the resumed run's.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import mxnet as mx
import pytest
from mxnet import gluon
from mxnet.gluon.contrib.estimator import BatchEnd, CheckpointHandler, EpochEnd, Estimator

import gluon_stream as gs
from _helpers import batch_ids, id_shards

pytestmark = pytest.mark.mxnet  # these tests use MXNet: warm its engine first

SIZES = [10, 7, 5, 9]  # 31 samples; batches of 4 with rollover: 7, 8, 8, 8 per epoch
EPOCHS = 4
EPOCH_ENDS = [7, 15, 23, 31]  # batches trained when each epoch ends


def make_loader(**kwargs) -> gs.StreamLoader:
    args = dict(batch_size=4, shuffle=True, seed=3, last_batch="rollover")
    args.update(kwargs)
    return gs.StreamLoader(gs.FunctionSource(range(len(SIZES)), id_shards(SIZES)), **args)


class Preempted(Exception):
    """Raised by a test handler to stop a run the way a preemption would."""


# -- Estimator ------------------------------------------------------------------------------
class Recorder(BatchEnd, EpochEnd):
    """Records each batch's ids and the batch count at each epoch end; raises Preempted after
    ``stop_after`` batches. Priority 1: after the checkpoint handler (0) at each event."""

    priority = 1

    def __init__(self, stop_after=None):
        self.stop_after = stop_after
        self.batches, self.epoch_ends = [], []

    def batch_end(self, estimator, *args, **kwargs):
        self.batches.append(batch_ids(kwargs["batch"]))
        if len(self.batches) == self.stop_after:
            raise Preempted
        return False

    def epoch_end(self, estimator, *args, **kwargs):
        self.epoch_ends.append(len(self.batches))
        return False


class Net(gluon.nn.HybridBlock):
    """Dense(1) over the ids as float32 (the shards' first array is int64 ids)."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.dense = gluon.nn.Dense(1, in_units=1)

    def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
        return self.dense(F.reshape(F.cast(x, "float32"), (-1, 1)))


def estimator() -> Estimator:
    net = Net()
    net.initialize(mx.init.Zero())
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 1e-8})
    est = Estimator(net, loss=gluon.loss.L2Loss(), trainer=trainer, context=mx.cpu())
    est.logger.disabled = True  # it logs each epoch to stdout
    return est


def fit(model_dir, *, epochs=None, batches=None, stop_after=None, resume=False,
        loader_args=None, **checkpoint_args) -> Recorder:
    """One Estimator run with a fresh loader and StreamCheckpoint; Preempted ends it quietly."""
    recorder = Recorder(stop_after)
    with make_loader(**(loader_args or {})) as loader:
        ckpt = gs.StreamCheckpoint(loader, str(model_dir), resume_from_checkpoint=resume,
                                   **checkpoint_args)
        try:
            estimator().fit(loader, epochs=epochs, batches=batches,
                            event_handlers=[ckpt, recorder])
        except Preempted:
            pass
    return recorder


def checkpoint_files(model_dir) -> dict:
    """{suffix: sorted prefixes} of the files in model_dir."""
    found: dict = {}
    for name in os.listdir(model_dir):
        for suffix in (".params", ".states", gs.checkpoint.STATE_SUFFIX):
            if name.endswith(suffix):
                found.setdefault(suffix, []).append(name[:-len(suffix)])
    return {suffix: sorted(prefixes) for suffix, prefixes in found.items()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The batches and epoch ends of a whole run; resume_from_checkpoint=True in an empty
    directory trains from scratch, as CheckpointHandler does."""
    run = fit(tmp_path_factory.mktemp("whole"), epochs=EPOCHS, resume=True)
    assert run.epoch_ends == EPOCH_ENDS
    return run


def check_resumed(whole, first, resumed, saved, rest_of_epoch=False):
    """``resumed`` continues ``first`` from its checkpoint after ``saved`` batches: together
    they are ``whole``, batch for batch, and the resumed epochs end where whole's do. A state
    saved after an epoch's last batch (a batch checkpoint) says "end of that epoch": the resumed
    run first passes over the epoch's rest, no batch, so its epoch end comes at ``saved``."""
    assert first.batches == whole.batches[:len(first.batches)]
    assert first.batches[:saved] + resumed.batches == whole.batches
    ends = [e for e in whole.epoch_ends if e > saved]
    assert [saved + e for e in resumed.epoch_ends] == [saved] * rest_of_epoch + ends


def check_files(model_dir):
    """Every checkpoint's .params and .states have a loader state beside them, and the state
    files removed with old checkpoints (max_checkpoints) are gone too; no temporary files."""
    files = checkpoint_files(model_dir)
    assert files[".params"] and files[".params"] == files[".states"] \
        == files[gs.checkpoint.STATE_SUFFIX]
    assert not [n for n in os.listdir(model_dir) if n.endswith(".tmp")]


@pytest.mark.parametrize("epoch_period, stop_after, saved", [
    (1, 18, 15),  # preempted in epoch 2: resumes at the start of epoch 2
    (2, 30, 15),  # checkpoints after epochs 1 and 3; preempted in epoch 3
    (1, 15, 7),   # preempted after epoch 1's last batch, before its epoch end saved
])
def test_estimator_resumes_from_epoch_checkpoints_with_the_same_batches(
        tmp_path, uninterrupted, epoch_period, stop_after, saved):
    first = fit(tmp_path, epochs=EPOCHS, stop_after=stop_after, epoch_period=epoch_period)
    check_files(tmp_path)
    resumed = fit(tmp_path, epochs=EPOCHS, resume=True, epoch_period=epoch_period)
    check_resumed(uninterrupted, first, resumed, saved)
    check_files(tmp_path)


@pytest.mark.parametrize("batch_period, stop_after, saved", [
    (3, 11, 9),   # mid-epoch 1: the resumed pass is the rest of epoch 1
    (5, 17, 15),  # after epoch 1's last batch: "end of epoch 1", a pass with no batch first
    (4, 6, 4),    # within epoch 0, at the first checkpoint
])
def test_estimator_resumes_from_batch_checkpoints_with_the_same_batches(
        tmp_path, uninterrupted, batch_period, stop_after, saved):
    total = EPOCH_ENDS[-1]
    periods = dict(epoch_period=None, batch_period=batch_period)
    first = fit(tmp_path, batches=total, stop_after=stop_after, **periods)
    check_files(tmp_path)
    resumed = fit(tmp_path, batches=total, resume=True, **periods)
    check_resumed(uninterrupted, first, resumed, saved, rest_of_epoch=saved in EPOCH_ENDS)
    check_files(tmp_path)


def test_estimator_resumes_after_a_run_of_fewer_epochs(tmp_path, uninterrupted):
    first = fit(tmp_path, epochs=2)
    resumed = fit(tmp_path, epochs=EPOCHS, resume=True)
    check_resumed(uninterrupted, first, resumed, saved=EPOCH_ENDS[1])


def test_estimator_resumes_after_a_run_of_fewer_batches(tmp_path, uninterrupted):
    periods = dict(epoch_period=None, batch_period=6)
    first = fit(tmp_path, batches=12, **periods)  # ends mid-epoch 1, at a checkpoint
    resumed = fit(tmp_path, batches=EPOCH_ENDS[-1], resume=True, **periods)
    check_resumed(uninterrupted, first, resumed, saved=12)


def test_old_checkpoints_take_their_loader_state_along(tmp_path):
    fit(tmp_path, batches=10, epoch_period=None, batch_period=1, max_checkpoints=2)
    assert checkpoint_files(tmp_path)[gs.checkpoint.STATE_SUFFIX] == [
        "model-epoch1batch8", "model-epoch1batch9"]
    check_files(tmp_path)

    none = tmp_path / "none"  # max_checkpoints=0: each save is removed at once
    fit(none, batches=3, epoch_period=None, batch_period=1, max_checkpoints=0)
    assert checkpoint_files(none) == {}


def test_a_missing_or_foreign_loader_state_is_refused_naming_the_file(tmp_path):
    fit(tmp_path, epochs=1)
    path = os.path.join(tmp_path, "model-epoch0batch7" + gs.checkpoint.STATE_SUFFIX)
    with open(path) as fp, make_loader() as loader:
        loader.load_state_dict(json.load(fp))
        assert loader.epoch == 1  # saved after the pass ended: epoch 1 from its start

    with pytest.raises(gs.InvalidState, match="other settings") as info:
        fit(tmp_path, epochs=2, resume=True, loader_args={"seed": 4})
    assert path in str(info.value)

    with open(path, "w") as fp:
        fp.write("{not json")
    with pytest.raises(gs.InvalidState, match="cannot read") as info:
        fit(tmp_path, epochs=2, resume=True)
    assert path in str(info.value)

    os.remove(path)
    with pytest.raises(gs.InvalidState, match="no loader state") as info:
        fit(tmp_path, epochs=2, resume=True)
    assert path in str(info.value)


@pytest.mark.parametrize("order", ["other first", "other after"])
@pytest.mark.parametrize("other_kind", ["CheckpointHandler", "StreamCheckpoint"])
def test_another_checkpoint_handler_in_the_same_fit_is_refused_naming_it(tmp_path, order,
                                                                          other_kind):
    """A 20-batch run resumed after 10 trained 4 more, not 10, silently: both handlers
    shortened what was left. Now the fit refuses before any batch, naming the other one."""
    periods = dict(epoch_period=None, batch_period=5)
    first = fit(tmp_path, batches=20, stop_after=10, **periods)
    assert len(first.batches) == 10
    recorder = Recorder()
    with make_loader() as loader, make_loader() as other_loader:
        ckpt = gs.StreamCheckpoint(loader, str(tmp_path), resume_from_checkpoint=True, **periods)
        other = (CheckpointHandler(str(tmp_path), resume_from_checkpoint=True, **periods)
                 if other_kind == "CheckpointHandler" else
                 gs.StreamCheckpoint(other_loader, str(tmp_path / "b"), **periods))
        handlers = [other, ckpt, recorder] if order == "other first" else [ckpt, other, recorder]
        model_dir = f"{tmp_path}{'' if other_kind == 'CheckpointHandler' else '/b'}"
        named = rf"{other_kind}\(model_dir='{model_dir}'"
        with pytest.raises(gs.CheckpointConflict, match=named + r".*Remove the other handler"):
            estimator().fit(loader, batches=20, event_handlers=handlers)
    assert recorder.batches == []


def test_stream_checkpoint_checks_its_arguments(tmp_path):
    with make_loader() as loader:
        with pytest.raises(TypeError, match="StreamLoader, got StreamIter: pass the StreamIter"):
            gs.StreamCheckpoint(gs.StreamIter(loader), str(tmp_path))
        with pytest.raises(ValueError, match="never saves"):
            gs.StreamCheckpoint(loader, str(tmp_path), epoch_period=None)
        with pytest.raises(ValueError, match="batch_period must be a positive integer, got 0"):
            gs.StreamCheckpoint(loader, str(tmp_path), batch_period=0)
        with pytest.raises(TypeError, match="StreamLoader, got str"):
            gs.do_checkpoint(str(tmp_path / "m"), "loader")
        with pytest.raises(ValueError, match="period must be a positive integer, got 0"):
            gs.do_checkpoint(str(tmp_path / "m"), loader, period=0)


def test_estimator_fit_takes_a_stream_loader(tmp_path):
    """``Estimator.fit(train_data=loader, val_data=loader2, epochs=N)`` as it is."""
    with make_loader() as loader, make_loader(shuffle=False, last_batch="keep") as val:
        ckpt = gs.StreamCheckpoint(loader, str(tmp_path))
        recorder = Recorder()
        estimator().fit(train_data=loader, val_data=val, epochs=2,
                        event_handlers=[ckpt, recorder])
    assert recorder.epoch_ends == EPOCH_ENDS[:2]


# -- Module ---------------------------------------------------------------------------------
def regression() -> mx.sym.Symbol:
    data = mx.sym.Cast(mx.sym.Variable("data"), dtype="float32")  # int64 ids
    out = mx.sym.FullyConnected(mx.sym.reshape(data, (-1, 1)), num_hidden=1, name="fc")
    return mx.sym.LinearRegressionOutput(out, name="lin")


def module_fit(prefix, *, num_epoch=EPOCHS, stop_after=None, period=1, begin_epoch=None):
    """One Module.fit with a fresh loader and do_checkpoint; ``begin_epoch`` resumes from the
    checkpoint of that number. Returns each batch's ids and the batch count at each epoch end."""
    batches, epoch_ends = [], []

    def record(param):
        batch = param.locals["data_batch"]
        ids = batch_ids(batch.data)
        batches.append(ids[:len(ids) - batch.pad])
        if len(batches) == stop_after:
            raise Preempted

    def epoch_end(*_):
        epoch_ends.append(len(batches))

    with make_loader() as loader:
        sym, arg_params, aux_params = regression(), None, None
        if begin_epoch is not None:
            sym, arg_params, aux_params = gs.load_checkpoint(prefix, begin_epoch, loader)
        it = gs.StreamIter(loader, data_names=["data"], label_names=["lin_label"])
        mod = mx.mod.Module(sym, data_names=["data"], label_names=["lin_label"],
                            context=mx.cpu())
        try:
            mod.fit(it, num_epoch=num_epoch, begin_epoch=begin_epoch or 0,
                    arg_params=arg_params, aux_params=aux_params, eval_metric="mse",
                    optimizer_params={"learning_rate": 1e-8},
                    batch_end_callback=record,
                    epoch_end_callback=[gs.do_checkpoint(prefix, loader, period), epoch_end])
        except Preempted:
            pass
        finally:
            it.close()
    return batches, epoch_ends


@pytest.fixture(scope="module")
def module_uninterrupted(tmp_path_factory):
    batches, epoch_ends = module_fit(str(tmp_path_factory.mktemp("whole") / "reg"))
    assert epoch_ends == EPOCH_ENDS
    return batches


@pytest.mark.parametrize("period, first_run, numbers", [
    (1, dict(stop_after=18), [1, 2]),  # preempted in epoch 2 (numbers: epochs done)
    (2, dict(stop_after=30), [2]),     # checkpoints after 2 and 4 epochs; preempted in the 4th
    (1, dict(num_epoch=3), [1, 2, 3]),  # a run of fewer epochs
])
def test_module_resumes_from_do_checkpoint_with_the_same_batches(
        tmp_path, module_uninterrupted, period, first_run, numbers):
    prefix = str(tmp_path / "reg")
    first, _ = module_fit(prefix, period=period, **first_run)
    assert sorted(os.listdir(tmp_path)) == sorted(
        [f"reg-{n:04d}{suffix}" for n in numbers for suffix in (".loader.json", ".params")]
        + ["reg-symbol.json"])

    epoch = numbers[-1]
    resumed, resumed_ends = module_fit(prefix, period=period, begin_epoch=epoch)
    saved = EPOCH_ENDS[epoch - 1]
    assert first[:saved] + resumed == module_uninterrupted
    assert [saved + e for e in resumed_ends] == EPOCH_ENDS[epoch:]


def test_load_checkpoint_refuses_a_missing_loader_state(tmp_path):
    prefix = str(tmp_path / "reg")
    module_fit(prefix, num_epoch=1)
    os.remove(prefix + "-0001.loader.json")
    with make_loader() as loader, pytest.raises(gs.InvalidState, match="no loader state") as info:
        gs.load_checkpoint(prefix, 1, loader)
    assert prefix + "-0001.loader.json" in str(info.value)


# -- without MXNet --------------------------------------------------------------------------
def test_without_mxnet_the_names_import_and_using_them_names_the_extra(tmp_path):
    code = ("import sys; sys.modules['mxnet'] = None\n"
            "from gluon_stream import *\n"
            "for make in (lambda: StreamCheckpoint(None, 'ckpt'),\n"
            "             lambda: do_checkpoint('p', None)):\n"
            "    try:\n"
            "        make()\n"
            "    except ImportError as e:\n"
            "        print('ERR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.stdout.count("ERR") == 2 and "gluon_stream[cpu]" in out.stdout, out.stderr
    assert not os.listdir(tmp_path)  # no checkpoint directory made
