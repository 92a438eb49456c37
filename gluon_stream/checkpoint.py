"""The loader's position inside MXNet's own checkpoints, so a resumed job neither retrains
nor skips data.

MXNet saves parameters and optimizer state, never where the data stream was. This module adds
the loader's :meth:`~gluon_stream.StreamLoader.state_dict` to both of MXNet's checkpoint
conventions, as a JSON file beside the parameters with a matching name:

* **Estimator** (``gluon.contrib.estimator``): :class:`StreamCheckpoint` is a
  ``CheckpointHandler`` (same arguments, same files, same moments) that also writes
  ``model-epoch{E}batch{B}.loader.json`` each time it saves ``.params`` and ``.states``, and,
  with ``resume_from_checkpoint=True``, restores the loader from the checkpoint it resumes
  from, in ``train_begin``, before the first batch is drawn. One handler writes both in one
  call, so the state always belongs to the batch after which the parameters were saved.
* **Module**: :func:`do_checkpoint` is ``mx.callback.do_checkpoint`` plus
  ``prefix-%04d.loader.json``; :func:`load_checkpoint` is ``mx.model.load_checkpoint`` plus
  the restore.

States are taken where the loop stands: after a batch (mid-epoch, or "end of epoch e" after
its last batch: the next pass yields nothing more of epoch e, the pass after is e + 1), or
after a pass ended (epoch e + 1 from its start). Either way every sample comes exactly once.
In a job of several ranks each rank writes its own state, ``{prefix}.rank{r}of{N}.loader.json``;
a resume on the same number of ranks loads its own, and one on another number of ranks merges
them all (:func:`~gluon_stream.merge_states`: an elastic resume, exact over the interrupted
epoch). State files are written atomically (a temporary file renamed into place); a missing or
unreadable one is an :class:`~gluon_stream.InvalidState` naming the file.
"""
from __future__ import annotations

import glob
import json
import logging
import os
import re
import tempfile
from typing import Any, Callable

from ._mx import import_mxnet, mxnet_available
from ._mx.estimator import fit_handlers
from ._utils import validate as _validate
from ._utils.files import remove_if_exists
from .elastic import merge_states
from .errors import CheckpointConflict, InvalidState
from .loader import StreamLoader

__all__ = ["STATE_SUFFIX", "StreamCheckpoint", "do_checkpoint", "load_checkpoint"]

logger = logging.getLogger(__name__)

STATE_SUFFIX = ".loader.json"  # after a checkpoint's prefix, beside its .params
_MODULE_PREFIX = "{prefix}-{epoch:04d}"  # mx.model.save_checkpoint's "%s-%04d.params"
_ESTIMATOR_PREFIX = "{prefix}-epoch{epoch}batch{batch}"  # CheckpointHandler's file prefix


def _check_loader(loader: Any) -> StreamLoader:
    if not isinstance(loader, StreamLoader):
        hint = (": pass the StreamIter's .loader" if type(loader).__name__ == "StreamIter"
                else "")
        raise TypeError(f"loader must be a gluon_stream.StreamLoader, got "
                        f"{type(loader).__name__}{hint}")
    return loader


def _rank_path(path: str, rank: int, parts: int) -> str:
    """A rank's state file of a checkpoint whose (one-rank) state file is ``path``."""
    return f"{path[:-len(STATE_SUFFIX)]}.rank{rank}of{parts}{STATE_SUFFIX}"


def _save_state(loader: StreamLoader, path: str) -> None:
    """Write ``loader.state_dict()`` to ``path`` (its rank's file in a job of several ranks) as
    JSON, atomically (temp file + rename)."""
    stream = loader.stream
    base_path = path
    if stream.num_parts > 1:
        path = _rank_path(path, stream.part_index, stream.num_parts)
    text = json.dumps(loader.state_dict(), indent=1, sort_keys=True)
    directory, base = os.path.split(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{base}.", suffix=".tmp", dir=directory or ".")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fp:
            fp.write(text)
            fp.flush()
            os.fsync(fp.fileno())
        os.replace(tmp, path)
    except BaseException:
        remove_if_exists(tmp)
        raise
    logger.debug("loader state saved to %s", path)
    _drop_other_world_sizes(base_path, stream.num_parts)


def _rank_files(path: str) -> dict[str, tuple[int, int]]:
    """The rank state files beside the one-rank state file ``path``: name -> (rank, ranks)."""
    stem = path[:-len(STATE_SUFFIX)]
    pattern = re.compile(re.escape(stem) + r"\.rank(\d+)of(\d+)" + re.escape(STATE_SUFFIX) + "$")
    found = {}
    for name in glob.glob(glob.escape(stem) + ".rank*of*" + STATE_SUFFIX):
        match = pattern.match(name)
        if match:
            found[name] = (int(match.group(1)), int(match.group(2)))
    return found


def _drop_other_world_sizes(path: str, parts: int) -> None:
    """A checkpoint written again under the same name by a job of ``parts`` ranks (a resized
    job reaching the same epoch and batch): the state files an earlier job of another size left
    there would be merged with the new ones, or preferred to them; they go (every rank removes
    them, whichever comes first)."""
    stale = [name for name, (_, ranks) in _rank_files(path).items() if ranks != parts]
    if parts > 1:
        stale.append(path)
    for name in stale:
        if os.path.exists(name):
            remove_if_exists(name)
            logger.info("removed %s: a state of a job of another number of ranks, at the name "
                        "this checkpoint is written again", name)


def _saved_states(loader: StreamLoader, path: str) -> tuple[Any, str]:
    """The state ``loader`` resumes from, of the checkpoint whose one-rank state file is
    ``path``: its own rank's, or the merge of every rank's where the job had another number
    of ranks (and the files it was read from, for messages)."""
    stream = loader.stream
    found = _rank_files(path)
    if not found:
        state = _read_state(path)
        return (state if stream.num_parts == 1 else _merged([state], path)), path
    own = _rank_path(path, stream.part_index, stream.num_parts)
    if own in found and all(parts == stream.num_parts for _, parts in found.values()):
        return _read_state(own), own
    names = sorted(found, key=found.__getitem__)
    where = f"{len(names)} rank state files {names[0]!r}..."
    merged = _merged([_read_state(name) for name in names], where)
    logger.info("elastic resume: the states of %d rank(s) merged for rank %d of %d", len(names),
                stream.part_index, stream.num_parts)
    return merged, where


def _merged(states: list, where: str) -> dict:
    try:
        return merge_states(states)
    except InvalidState as exc:
        raise InvalidState(f"{where}: {exc}") from exc


def _read_state(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as fp:
            return json.load(fp)
    except FileNotFoundError:
        raise InvalidState(
            f"no loader state at {path!r}: the checkpoint beside it was saved without the "
            "loader's position (not by gluon_stream, or the job stopped between writing the "
            "parameters and the state). Resume from an earlier checkpoint (remove this one's "
            "files), or start the loader afresh") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidState(f"cannot read the loader state {path!r}: {exc}") from exc


def _restore_state(loader: StreamLoader, path: str) -> None:
    """``loader.load_state_dict`` from the JSON file at ``path`` (or the files of every rank
    beside it, merged where the job had another number of ranks); InvalidState names it."""
    state, path = _saved_states(loader, path)
    try:
        loader.load_state_dict(state)
    except InvalidState as exc:
        raise InvalidState(f"loader state {path!r}: {exc}") from exc
    logger.info("loader restored from %s: epoch %d continues", path, loader.epoch)


def do_checkpoint(prefix: str, loader: StreamLoader,
                  period: int = 1) -> Callable[[int, Any, dict, dict], None]:
    """``mx.callback.do_checkpoint`` that saves the loader's position too, for ``Module.fit``.

    Every ``period`` epochs it saves what MXNet's callback saves (``prefix-symbol.json``,
    ``prefix-%04d.params`` numbered by epochs done) and then the loader's state as
    ``prefix-%04d.loader.json``. ``Module.fit`` calls it after the pass ended, so the state
    says "the next epoch, from its start" (with any ``last_batch='rollover'`` carry). Resume
    with :func:`load_checkpoint` and ``Module.fit(begin_epoch=epoch)``.

    Args:
        prefix: Path prefix of the checkpoint files, as for ``mx.callback.do_checkpoint``.
        loader: The StreamLoader under the ``StreamIter`` that ``fit`` trains on.
        period: Epochs between checkpoints (default 1).

    Returns:
        A callback for ``Module.fit(epoch_end_callback=...)``.

    Example:
        >>> import os, tempfile, mxnet as mx, numpy as np, gluon_stream as gs
        >>> src = gs.FunctionSource(range(2), lambda k: (np.ones((8, 3), "float32"),
        ...                                              np.zeros(8, "float32")))
        >>> net = mx.sym.SoftmaxOutput(mx.sym.FullyConnected(mx.sym.Variable("data"),
        ...                                                  num_hidden=2), name="softmax")
        >>> with tempfile.TemporaryDirectory() as d, gs.StreamLoader(src, batch_size=4) as loader:
        ...     mx.mod.Module(net).fit(gs.StreamIter(loader), num_epoch=2,
        ...                            epoch_end_callback=gs.do_checkpoint(d + "/mlp", loader))
        ...     print(*sorted(os.listdir(d)), sep="\\n")
        mlp-0001.loader.json
        mlp-0001.params
        mlp-0002.loader.json
        mlp-0002.params
        mlp-symbol.json
    """
    mx = import_mxnet()
    _check_loader(loader)
    period = _validate.integer("period", period, minimum=1)
    save_params = mx.callback.do_checkpoint(prefix, period)

    def _callback(iter_no: int, sym: Any, arg: dict, aux: dict) -> None:
        save_params(iter_no, sym, arg, aux)
        if (iter_no + 1) % period == 0:  # the epochs mx.callback.do_checkpoint saves
            _save_state(loader, _MODULE_PREFIX.format(prefix=prefix, epoch=iter_no + 1)
                        + STATE_SUFFIX)

    return _callback


def load_checkpoint(prefix: str, epoch: int, loader: StreamLoader) -> tuple[Any, dict, dict]:
    """``mx.model.load_checkpoint`` that also puts the loader where that checkpoint left it.

    Call it before the ``StreamIter`` hands out its first batch (before ``fit`` or
    ``provide_data``), then ``Module.fit(it, begin_epoch=epoch, arg_params=arg_params,
    aux_params=aux_params, ...)``. The loader's next pass is then epoch ``epoch`` (no
    ``set_epoch`` needed), continuing with exactly the batches the interrupted run would have
    drawn next.

    Args:
        prefix: Path prefix given to :func:`do_checkpoint`.
        epoch: The checkpoint's number (epochs done), as in ``prefix-%04d.params``.
        loader: A StreamLoader built with the same arguments as the one saved.

    Returns:
        ``(symbol, arg_params, aux_params)``, as ``mx.model.load_checkpoint`` returns them.

    Raises:
        InvalidState: the loader state file is missing, unreadable, or from other settings.

    Example:
        >>> import tempfile, mxnet as mx, numpy as np, gluon_stream as gs
        >>> def make_loader():  # a source belongs to one loader: each run makes its own
        ...     return gs.StreamLoader(gs.FunctionSource(range(2), lambda k: (
        ...         np.ones((8, 3), "float32"), np.zeros(8, "float32"))), batch_size=4)
        >>> net = mx.sym.SoftmaxOutput(mx.sym.FullyConnected(mx.sym.Variable("data"),
        ...                                                  num_hidden=2), name="softmax")
        >>> with tempfile.TemporaryDirectory() as d:
        ...     with make_loader() as loader:  # preempted after epoch 0
        ...         mx.mod.Module(net).fit(gs.StreamIter(loader), num_epoch=1,
        ...                                epoch_end_callback=gs.do_checkpoint(d + "/mlp", loader))
        ...     with make_loader() as loader:  # a new process
        ...         sym, arg_params, aux_params = gs.load_checkpoint(d + "/mlp", 1, loader)
        ...         print(loader.epoch)
        ...         mx.mod.Module(sym).fit(gs.StreamIter(loader), begin_epoch=1, num_epoch=2,
        ...                                arg_params=arg_params, aux_params=aux_params)
        1
    """
    mx = import_mxnet()
    _check_loader(loader)
    epoch = _validate.integer("epoch", epoch, minimum=0)
    params = mx.model.load_checkpoint(prefix, epoch)
    _restore_state(loader, _MODULE_PREFIX.format(prefix=prefix, epoch=epoch) + STATE_SUFFIX)
    return params


def _checkpoint_handler_base() -> type:
    """MXNet's ``CheckpointHandler``, or ``object`` where MXNet cannot be imported (then
    ``StreamCheckpoint(...)`` raises the ImportError that names the extra to install)."""
    return import_mxnet().gluon.contrib.estimator.CheckpointHandler if mxnet_available() \
        else object


class StreamCheckpoint(_checkpoint_handler_base()):  # type: ignore[misc]
    """Estimator ``CheckpointHandler`` that saves and restores the loader's position too.

    Use it instead of ``CheckpointHandler`` (same arguments, after the loader). Whenever it
    saves ``{model_prefix}-epoch{E}batch{B}.params`` and ``.states`` (every ``epoch_period``
    epochs and/or ``batch_period`` batches, as ``CheckpointHandler`` does), it writes the
    loader's state beside them as ``{model_prefix}-epoch{E}batch{B}.loader.json``, in the
    same handler call: after the batch's ``trainer.step`` (``GradientUpdateHandler`` runs
    first, priority -2000) and before the next batch is drawn. Old checkpoints removed by
    ``max_checkpoints`` take their state file with them. The ``-best`` checkpoint gets no state
    (resuming never reads it).

    With ``resume_from_checkpoint=True`` it restores the loader, in ``train_begin``, from the
    checkpoint whose parameters ``CheckpointHandler`` loads (the newest), so the first batch
    drawn is the one the interrupted run would have drawn next. MXNet's rules apply: train by
    ``epochs`` with ``batch_period=None``, or by ``batches`` with ``epoch_period=None``, and
    ``fit`` trains only what is left. A resume from the end of an epoch (a batch checkpoint
    after its last batch) first runs that epoch's rest, a pass with no batch, so the
    epoch-end handlers (validation, logging) run once for it before the next epoch.

    Args:
        loader: The StreamLoader given to ``Estimator.fit`` as ``train_data``.
        model_dir: Directory of the checkpoint files (created if missing).
        model_prefix: File name prefix (default ``'model'``).
        monitor, verbose, save_best, mode, max_checkpoints: As for ``CheckpointHandler``.
        epoch_period: Epochs between checkpoints (default 1; None for none).
        batch_period: Batches between checkpoints (default None).
        resume_from_checkpoint: Load the newest checkpoint in ``model_dir``, parameters,
            trainer states and loader state, before training (default False).

    Example:
        >>> from mxnet.gluon.contrib.estimator import Estimator  # doctest: +SKIP
        >>> with gs.StreamLoader(src, batch_size=32) as loader:  # doctest: +SKIP
        ...     ckpt = gs.StreamCheckpoint(loader, "ckpt", resume_from_checkpoint=True)
        ...     Estimator(net, loss, trainer=trainer).fit(loader, epochs=3,
        ...                                                event_handlers=[ckpt])
        >>> print(*sorted(os.listdir("ckpt"))[:3], sep="\\n")  # doctest: +SKIP
        model-epoch0batch12.loader.json
        model-epoch0batch12.params
        model-epoch0batch12.states
    """

    def __init__(self, loader: StreamLoader, model_dir: str, model_prefix: str = "model", *,
                 monitor: Any = None, verbose: int = 0, save_best: bool = False,
                 mode: str = "auto", epoch_period: int | None = 1,
                 batch_period: int | None = None, max_checkpoints: int = 5,
                 resume_from_checkpoint: bool = False) -> None:
        import_mxnet()
        _check_loader(loader)
        for name, period in (("epoch_period", epoch_period), ("batch_period", batch_period)):
            if period is not None:
                _validate.integer(name, period, minimum=1, hint="or None for no such checkpoints")
        if epoch_period is None and batch_period is None:
            raise ValueError("StreamCheckpoint with epoch_period=None and batch_period=None never "
                             "saves: set one of them")
        super().__init__(model_dir, model_prefix, monitor=monitor, verbose=verbose,
                         save_best=save_best, mode=mode, epoch_period=epoch_period,
                         batch_period=batch_period,
                         max_checkpoints=_validate.integer("max_checkpoints", max_checkpoints,
                                                           minimum=0),
                         resume_from_checkpoint=bool(resume_from_checkpoint))
        self.loader = loader

    def train_begin(self, estimator: Any, *args: Any, **kwargs: Any) -> None:
        """Resume as ``CheckpointHandler`` does, then restore the loader from that checkpoint.

        Raises:
            CheckpointConflict: another checkpoint handler is in the same ``fit`` (before
                anything is loaded).
        """
        self._check_alone(estimator)
        super().train_begin(estimator, *args, **kwargs)
        if self.resume_from_checkpoint and self.trained_epoch >= 0:
            prefix = _ESTIMATOR_PREFIX.format(prefix=self.model_prefix, epoch=self.trained_epoch,
                                              batch=self.trained_batch)
            _restore_state(self.loader, os.path.join(self.model_dir, prefix + STATE_SUFFIX))

    def _check_alone(self, estimator: Any) -> None:
        """Refuse another ``CheckpointHandler`` (or StreamCheckpoint) in the same ``fit``: each
        shortens a resumed run by the epochs or batches it finds trained (a 20-batch run resumed
        after 10 would train 4, not 10), and its checkpoints carry no loader state."""
        base = import_mxnet().gluon.contrib.estimator.CheckpointHandler
        others = [h for h in fit_handlers(estimator) or () if h is not self and isinstance(h, base)]
        if others:
            named = ", ".join(f"{type(h).__name__}(model_dir={h.model_dir!r}, "
                              f"model_prefix={h.model_prefix!r})" for h in others)
            raise CheckpointConflict(
                f"StreamCheckpoint(model_dir={self.model_dir!r}) shares Estimator.fit with "
                f"{named}: each checkpoint handler shortens a resumed run by what it finds "
                "trained, so the run would train less than asked, and only StreamCheckpoint "
                "saves the loader's position. Remove the other handler: StreamCheckpoint takes "
                "CheckpointHandler's arguments (save_best, monitor, max_checkpoints, periods)")

    def batch_end(self, estimator: Any, *args: Any, **kwargs: Any) -> Any:
        """Save as ``CheckpointHandler`` does; when it saved, save the loader's state beside."""
        return self._with_loader_state(super().batch_end, estimator, *args, **kwargs)

    def epoch_end(self, estimator: Any, *args: Any, **kwargs: Any) -> Any:
        """Save as ``CheckpointHandler`` does; when it saved, save the loader's state beside."""
        return self._with_loader_state(super().epoch_end, estimator, *args, **kwargs)

    def _with_loader_state(self, event: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        # CheckpointHandler appends the prefix of each periodic save to saved_checkpoints (not
        # the -best one's), so a new last entry is a save; with max_checkpoints=0 it removes
        # the save at once and the list stays empty: nothing to write beside.
        before = self.saved_checkpoints[-1:]
        result = event(*args, **kwargs)
        after = self.saved_checkpoints[-1:]
        if after and after != before:
            _save_state(self.loader, os.path.join(self.model_dir, after[0] + STATE_SUFFIX))
        return result
