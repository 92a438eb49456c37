"""StreamLoader: batches over a stream of shards, nothing lost or duplicated at shard boundaries.

The loader wires the stages of each pass (an epoch): a :class:`~gluon_stream.ShardStream` (shards
produced ahead), a planner (which samples form which batch, where a resume starts: the pure
promise of :mod:`gluon_stream._stages.batching`) and one of two ways to turn planned batches into
data, chosen automatically:

* **vectorised** (no ``batchify_fn``, no ``sample_transform``): the producer thread copies
  the (already shuffled) shard into one NDArray in the background; batches are contiguous
  slices of it. No per-sample Python work, no worker pool, rotation costs microseconds,
  and the batches are exactly those a ``gluon.data.DataLoader`` would build.
* **per-sample** (a ``batchify_fn`` or ``sample_transform`` is given): samples are made and
  batched by workers: in the loop's thread
  (``num_workers=0``), in threads (``thread_pool=True``), or, by default for
  ``num_workers > 0`` as in Gluon, in worker processes forked once per loader and fed each shard
  through shared memory. Batches are submitted ahead, across shard boundaries.
"""
from __future__ import annotations

import inspect
import logging
import weakref
from concurrent.futures import Executor
from typing import Any, Callable, Generator, Mapping, Sequence

from . import _mx as mx_arrays
from ._memory.tuner import Tuner
from ._mx import as_numpy_batch, gluon_data_loader, import_mxnet, numpy_mode
from ._mx import workers as mx_workers
from ._mx.samples import SAMPLE_FORMATS, SampleFormat
from ._stages.batch_paths import SamplePath, SlicePath
from ._stages.batching import LAST_BATCH_MODES, LastBatch
from ._stages.contracts import BatchPath, Workers
from ._stages.epoch import BatchCounts, LoaderEpoch, PassSettings, PassStarts
from ._stages.keys import ShardSizes, resolve_parts, synchronous_job
from ._stages.produce import OnError
from ._stages.provenance import Provenance, ProvenanceTracker
from ._stages.ranks import choose_deal
from ._stages.state import LoaderState, decode_state, encode_state
from ._utils import validate as _validate
from ._utils.closing import Closing
from ._utils.lifecycle import check_owner, track, usable_cores
from .elastic import load_any, remainder_fields
from .errors import LoaderClosed
from .sources import Source
from .stats import Stats
from .stream import ShardStream

__all__ = ["StreamLoader"]

logger = logging.getLogger(__name__)

class _LoaderResources:
    """What a StreamLoader owns: its stream (if it built it) and its batch path's workers."""

    def __init__(self, stream: ShardStream, owns_stream: bool, path: Any) -> None:
        self.stream = stream
        self.owns_stream = owns_stream
        self.path = path
        self.closed = False

    def close(self) -> None:
        self.closed = True
        self.path.close()
        if self.owns_stream:
            self.stream.close()


#: StreamLoader's arguments that configure its ShardStream (given one, they must not be given)
_STREAM_ARGS = ("transform", "shuffle", "seed", "prefetch", "producers", "on_error", "schema",
                "stats", "num_parts", "part_index", "kvstore", "shard_sizes", "num_epochs",
                "memory_budget", "context_rows", "context_break")


class StreamLoader(Closing):
    """Iterate full, shuffled batches over shards produced on demand.

    Args:
        source: A source (``CommandSource``, ``FunctionSource``, ``FileSource``) or a
            :class:`ShardStream`. With a stream, set ``transform``/``shuffle``/``seed``/
            ``prefetch``/``producers``/``on_error``/``schema`` on the stream.
        batch_size: Samples per batch.
        transform: ``transform(raw) -> arrays`` per shard, in a background producer thread.
        sample_transform: ``fn(*sample) -> sample`` per sample (like ``Dataset.transform``);
            selects the per-sample path.
        sample_format: What per-sample code receives: ``'auto'`` (default: numpy rows, or
            NDArrays once MXNet/GluonCV code rejects numpy, as GluonCV's ``RandomCrop``
            does), ``'numpy'`` or ``'ndarray'``.
        shuffle: Shuffle shard order and samples within shards, from ``(seed, epoch)``
            (default False).
        shuffle_window: With ``shuffle=True``, mix the samples of this many consecutive shards
            (default 1: each batch holds samples of one shard, except at boundaries). A sliding
            window: shard ``j``'s samples are spread over ``shuffle_window`` consecutive units,
            so every batch mixes up to this many shards, batches start as soon as the first
            shard is in, and at most ``max(prefetch, shuffle_window) + 1`` shards are held.
        seed: Shuffle seed (None: drawn once, logged).
        last_batch: ``'keep'`` (default, as Gluon), ``'discard'`` or ``'rollover'``; applies at
            the end of the epoch only, leftovers always cross shard boundaries.
        num_workers, thread_pool, batchify_fn, pin_memory, pin_device_id, timeout: As in
            ``gluon.data.DataLoader``: ``num_workers > 0`` forks that many worker processes
            (once, here), ``thread_pool=True`` uses threads instead. Without
            ``batchify_fn``/``sample_transform`` batches are slices and no workers are needed.
        prefetch: Shards produced ahead of the one being consumed. ``'auto'`` (default): 2,
            or tuned within ``memory_budget``.
        producers: Shards produced in parallel (threads), or a
            ``concurrent.futures.Executor`` (e.g. a dask client's) that generates them into a
            shared ``cache_dir``. ``'auto'`` (default): one, and more while the loop waits for
            shards and cores are free (see :class:`ShardStream`).
        on_error: ``'raise'`` (default), ``'skip'`` or ``('retry', n)`` per shard.
        schema: Expected ``[(dtype, trailing_shape), ...]``; default: the first shard's.
        stats: A :class:`Stats` to record into (default: a new one, ``loader.stats``).
        progress: Show a bar per epoch (samples/s, share of time waiting, shards ahead): it
            redraws on a terminal or in Jupyter and writes one line per epoch into a file or
            pipe; ``'live'`` redraws wherever it goes.
        num_parts, part_index: This rank's part of every epoch's shards (MXNet's names);
            ``'auto'`` reads them from ``kvstore``, Horovod or the launcher's environment.
        kvstore: An MXNet kvstore to read the rank from with ``'auto'``.
        even_batches: Every part yields the same number of batches per epoch, so synchronous
            training never waits on a rank that ran out. ``True`` (for training): only full
            batches; with every shard's size known ahead (``shard_sizes=``, ``FileSource``
            headers, a cache filled by ``gluon-stream generate``) the shards are dealt to the
            parts and each yields the smallest part's count; otherwise every rank produces
            every shard and takes its stride of each one's samples, the strides going on from
            shard to shard (``deal='balanced'``: every part holds the epoch's samples
            ``// num_parts`` or one more, with no size known; pair it with a shared
            ``cache_dir``). ``'pad'`` (for
            exact evaluation): every sample of the epoch once among the parts' real rows; every
            part yields the largest part's count of batches of ``batch_size`` rows, the last
            ones padded at their end (:attr:`pad` says how many rows are padding).
        shard_sizes: Samples per shard after ``transform``, when headers cannot tell (for
            ``len()`` and ``even_batches``): ``{key: samples}``, ``fn(key)``, or one int for
            every shard.
        num_epochs: How many epochs will be run, if known: the last epoch's end then does not
            produce the next epoch's first shards ahead.
        ctx: Where batches arrive: one context (``mx.gpu(0)``), or a list, and then each array
            arrives split across them as ``gluon.utils.split_and_load(x, ctx, even_split=False)``
            gives it (a list per array). The copy of the next batch is started before the
            current one is handed out, whenever the next one is ready, so it runs while the
            loop trains; batches never share memory with one the loop still has.
        samples_per_epoch: Epochs of this many samples (per part) over the stream of shards,
            for endless key iterators (new dates keep arriving) or epochs that cut across the
            key list: each pass yields exactly that many samples, with ``last_batch`` applied
            there, so ``len()`` is known ahead; the next epoch goes on where this one stopped
            in the stream (finite keys are read pass after pass, each pass shuffled from
            ``(seed, pass)``). Epochs are then read in order (``set_epoch`` to the next one, or
            a loaded state).
        shards_on_ctx: With one ``ctx`` and no per-sample work, copy each whole shard there in
            its producer thread, so batches are slices already on the device and nothing is
            copied per batch; costs up to ``prefetch + 1`` shards of device memory.
        memory_budget: Bytes, or a string with a unit (``"4GiB"``, ``"512MB"``), the loader may
            hold for data: shards produced or loading, the copies producers make, batches in
            flight and the per-sample workers' slots. Within it ``prefetch``, ``producers`` and,
            on the per-sample path, the worker processes making batches (one is forked per
            usable core, and batches go to as many as help) are tuned live from where the
            loop waits (a setting given explicitly stays as given); each change is logged at INFO
            with its reason and kept in ``loader.stats.tuning``. A budget that cannot hold the shard
            being trained on plus one more raises :class:`~gluon_stream.MemoryBudgetTooSmall` before
            the first batch of the shard that shows it. Batches are the same whatever the tuner
            picks. See the performance guide.
        provenance: Record where each sample of a batch came from: after each batch,
            :attr:`last_provenance` gives every row's shard key, row in that shard's raw output
            (before the shuffle and the ranks' parts), the epoch the shard was made for, and
            which rows are padding. Off by default, and then it costs nothing; on, a few
            microseconds per batch and each shard's row order kept while it is read (see the
            troubleshooting of loss spikes in the batches guide).
        context_rows: ``transform`` receives the last ``context_rows`` raw rows before the
            shard's key, in the source's key order (before any shuffle or deal), followed by
            the shard's own rows, from as many previous keys as needed: windows span the
            shards' boundaries, and the key list yields the windows one long series would. The
            first key gets none; every other key the same rows whichever rank, shuffle or
            resume reads it. Needs a ``transform`` and a key list; give a ``cache_dir`` (a
            producer re-reads the previous keys' shards). See the time-series guide.
        context_break: ``fn(previous_key, key) -> bool``: True where context must not flow
            (a gap in the dates, a new episode): the series starts afresh at ``key``.

    Example:
        >>> import numpy as np
        >>> from gluon_stream import FunctionSource
        >>> src = FunctionSource(range(3), lambda k: np.arange(10.0))
        >>> with StreamLoader(src, batch_size=4) as loader:
        ...     [len(b) for b in loader]
        [4, 4, 4, 4, 4, 4, 4, 2]
    """

    _named: frozenset[str] = frozenset()  # the arguments the caller named (see __new__)

    def __new__(cls, *args: Any, **kwargs: Any) -> "StreamLoader":
        """A StreamLoader is a ``gluon.data.DataLoader`` too (``Estimator.fit`` and
        ``evaluate`` check ``isinstance``); MXNet is imported here, at first use. The names of
        the arguments the caller gave are kept: those a :class:`ShardStream` owns are refused
        next to one, whatever their value."""
        self: StreamLoader = super().__new__(gluon_data_loader(cls))
        self._named = frozenset(kwargs)
        return self

    def __init__(self, source: Source | ShardStream, batch_size: int, *,
                 transform: Callable[[Any], Any] | None = None,
                 sample_transform: Callable[..., Any] | None = None,
                 sample_format: SampleFormat = "auto", shuffle: bool = False,
                 shuffle_window: int = 1, seed: int | None = None,
                 last_batch: LastBatch = "keep", num_workers: int = 0,
                 thread_pool: bool = False,
                 batchify_fn: Callable[[list], Any] | None = None, pin_memory: bool = False,
                 pin_device_id: int = 0, timeout: float = 120,
                 prefetch: int | str = "auto", producers: int | str | Executor = "auto",
                 on_error: OnError = "raise",
                 schema: Sequence[tuple[Any, Sequence[int]]] | None = None,
                 stats: Stats | None = None, progress: bool | str = False,
                 num_parts: int | str = 1, part_index: int | str = 0,
                 kvstore: Any = None, even_batches: bool | str = False,
                 shard_sizes: Mapping[Any, int] | Callable[[Any], int] | int | None = None,
                 num_epochs: int | None = None,
                 ctx: Any = None, shards_on_ctx: bool = False,
                 samples_per_epoch: int | None = None,
                 memory_budget: int | str | None = None, provenance: bool = False,
                 context_rows: int = 0,
                 context_break: Callable[[Any, Any], bool] | None = None) -> None:
        import_mxnet()
        named = self._named
        # the stream's arguments the caller gave (the stream's defaults for the others)
        given = {name: value for name, value in locals().items()
                 if name in _STREAM_ARGS and name in named}
        self.batch_size = _validate.integer("batch_size", batch_size, minimum=1)
        self.last_batch = _validate.choice("last_batch", last_batch, LAST_BATCH_MODES)
        _check_even_batches(even_batches, self.last_batch)
        self.num_workers, self.timeout, self.sample_format = _per_sample_args(
            num_workers, timeout, sample_format, sample_transform, batchify_fn)
        stream, owns = _stream_of(source, given, even_batches, samples_per_epoch,
                                   self.batch_size)
        self.shuffle_window = _validate.integer("shuffle_window", shuffle_window, minimum=1)
        _check_stream_fits(stream, self.shuffle_window, even_batches)
        self.even_batches: bool | str = even_batches
        self.thread_pool, self.batchify_fn = thread_pool, batchify_fn
        self.sample_transform = sample_transform
        self.pin_memory, self.pin_device_id = pin_memory, pin_device_id
        self.stream, self.progress = stream, progress
        self.vectorised = batchify_fn is None and sample_transform is None
        # memory_budget on the per-sample path, num_workers not given: the tuner picks how
        # many of one worker process per usable core (forked here, once) make batches
        self._tuned_workers = usable_cores() if stream.tuner is not None \
            and not self.vectorised and "num_workers" not in named and not thread_pool else 0
        self.num_workers = self._tuned_workers or self.num_workers
        self.samples_per_epoch = (None if samples_per_epoch is None else _validate.integer(
            "samples_per_epoch", samples_per_epoch, minimum=1, hint="or None"))
        stream.dealer.keep_keys = self.samples_per_epoch is not None  # epochs restart passes
        self._starts = PassStarts(stream, self.samples_per_epoch, self.batch_size,
                                  self.last_batch, self.shuffle_window)
        self._counts = BatchCounts(stream, self.batch_size, self.last_batch, even_batches,
                                   self.samples_per_epoch)
        #: a synchronous job's kind, saved with every state (merge_states compares the ranks'
        #: positions by it)
        self._job = synchronous_job(given.get("kvstore")) if stream.num_parts > 1 else None
        self.ctx = _check_ctx(ctx, shards_on_ctx, self.vectorised)
        self.shards_on_ctx = bool(shards_on_ctx)
        self._wire(owns, progress, provenance, remote=isinstance(producers, Executor))

    def _wire(self, owns: bool, progress: bool | str, provenance: bool, remote: bool) -> None:
        """The loader's own stages and resources: its batch path, its pass settings, what it
        closes, the tuner's watch, the stats' description and provenance."""
        stream = self.stream
        self._path = path = _batch_path(self, stream.error_policy.retries)
        self._settings = PassSettings(self.batch_size, self.last_batch, self.shuffle_window,
                                      self.even_batches, progress,
                                      None if self.shards_on_ctx else self.ctx,
                                      self.samples_per_epoch)
        self._resources = _LoaderResources(stream, owns, path)
        if stream.tuner is not None:  # what the loader holds besides shards
            _watch(self, stream.tuner, path)
        _describe(self, remote)
        # provenance=True: shards keep their row order, the passes note their batches' units
        self._origins = _tracker(provenance)
        stream.producer.keep_origins |= self._origins is not None
        self._finalizer = weakref.finalize(self, self._resources.close)
        track(self, self._finalizer)

    # -- public API -----------------------------------------------------------------------
    @property
    def stats(self) -> Stats:
        """Per-shard and per-epoch records (see :class:`Stats`)."""
        return self.stream.stats

    @property
    def epoch(self) -> int:
        """The epoch the next iteration will produce."""
        return self._starts.epoch

    @property
    def names(self) -> tuple[str, ...] | None:
        """The names of the arrays in a batch, in order, when the shards name them (a dict
        returned by ``fn`` or ``transform``, an ``.npz`` saved by name); None otherwise."""
        last = self._starts.last
        return last.names if last is not None else None

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch of the next pass (its keys, shuffle order and cache entries)."""
        self._starts.set_epoch(_validate.integer("epoch", epoch, minimum=0))

    def __bool__(self) -> bool:
        """Always true: ``if val_data:`` (Estimator) must not ask ``len()``, which is unknown
        (a TypeError) before the sizes are, or 0 for an epoch with no batch."""
        return True

    def __len__(self) -> int:
        """Batches of the next pass's epoch, counted from its start, as a fresh job of this
        size yields them: with even_batches the count every part yields (the same on every
        rank). A loaded state does not change it, of the same world size or merged from
        another (an elastic resume): the resumed pass yields the rest of it."""
        return self._counts.fresh_len(self.epoch, self._starts.next(warn=False).position)

    @property
    def pad(self) -> int:
        """Rows at the end of the batch just yielded that are padding (``even_batches='pad'``),
        as ``DataBatch.pad``: 0 for every batch but an epoch's last ones."""
        last = self._starts.last
        return last.pad if last is not None else 0

    @property
    def last_provenance(self) -> Provenance | None:
        """Where each row of the batch just yielded came from (``provenance=True``): a
        :class:`Provenance` of keys, raw rows, epochs and the padding mask; None before the
        first batch."""
        if self._origins is None:
            raise ValueError("last_provenance needs StreamLoader(..., provenance=True)")
        return self._origins.last

    def __iter__(self) -> Generator[Any, None, None]:
        """The next pass's batches: ``mx.np.ndarray`` while the iterating thread has Gluon's
        numpy semantics on (``npx.set_np()``, checked at each batch, as Gluon's DataLoader
        checks it where it batches), legacy ``mx.nd.NDArray`` otherwise."""
        return self._iterate(legacy=False)

    def _iterate(self, legacy: bool) -> Generator[Any, None, None]:
        """A pass's batches; ``legacy``: legacy NDArrays whatever the mode (the Module API's
        :class:`~gluon_stream.StreamIter`, as MXNet's own ``NDArrayIter``)."""
        self._check_open()
        self._starts.last = _new_pass(self)
        return _held(self, iter(self._starts.last), legacy)

    def state_dict(self) -> dict:
        """Where the stream stands, as a small JSON-serialisable dict (take it between batches).

        A fresh loader with the same arguments continues, after :meth:`load_state_dict`, with
        exactly the batches this one would have produced next. Taken after an epoch's last
        batch (before the loop sees the end), the state says "end of epoch e": a pass resumed
        from it yields nothing and the next pass is epoch e + 1. Taken once a pass has ended,
        it says "epoch e + 1, from its start". The state records the keys it refers to (a
        resume with a changed key list is refused instead of repeating or skipping samples) and
        a checksum (an edited state is refused).
        """
        return _saved_state(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict` of a loader built with the same arguments.

        A loader whose seed was drawn (``seed=None``) takes the state's seed.

        Raises:
            InvalidState: (a ValueError) the state is not a StreamLoader state, it was edited,
                a field is out of range, it was saved with other settings, or the keys it
                refers to changed.
        """
        self._check_open()
        self._starts.load(_loaded_state(self, state))

    def close(self) -> None:
        """Stop producers, end worker pools, kill generators, remove temp files; idempotent."""
        self._finalizer()

    def _check_open(self) -> None:
        check_owner(self, "StreamLoader")
        if self._resources.closed:
            raise LoaderClosed("this StreamLoader is closed; create a new one")
        self.stream.check_open()


def _new_pass(loader: StreamLoader) -> LoaderEpoch:
    """The loader's next pass: from where it stands (a loaded state, the last pass's carry and
    the run it handed over), its batches counted where the bar or even_batches need them."""
    start, carry, handover = loader._starts.begin()
    counts = loader._counts
    end = start.position.end  # the rest of an ended epoch (a resumed state): nothing
    limit = None if end or not loader.even_batches else counts.even_limit(start.epoch)
    expected = counts.batches(start.epoch, start.position.carried) \
        if loader.progress and not end else None
    new = LoaderEpoch(loader.stream, loader._path, loader._settings, start, limit, expected,
                    carry, handover)
    new.origins = loader._origins
    return new


def _per_sample_args(num_workers: int, timeout: float, sample_format: Any,
                     sample_transform: Any, batchify_fn: Any) -> tuple[int, float, Any]:
    """The per-sample path's arguments, checked: ``num_workers``, ``timeout`` and
    ``sample_format`` (``sample_transform`` and ``batchify_fn``: callables or None)."""
    _validate.callable_or_none("sample_transform", sample_transform)
    _validate.callable_or_none("batchify_fn", batchify_fn)
    return (_validate.integer("num_workers", num_workers, minimum=0),
            _validate.seconds("timeout", timeout),
            _validate.choice("sample_format", sample_format, SAMPLE_FORMATS))


def _check_stream_fits(stream: ShardStream, shuffle_window: int,
                       even_batches: bool | str) -> None:
    """Refuse a stream whose settings the loader's cannot hold: a shuffle window without
    shuffling, and equal batch counts that a failure on one rank only would break."""
    if shuffle_window > 1 and not stream.shuffle:
        raise ValueError(f"shuffle_window={shuffle_window} mixes the samples of several "
                         "shards for shuffle=True; pass shuffle=True (and a seed)")
    if even_batches and stream.deal != "shards" and stream.on_error == "skip" \
            and not stream.source.agrees_on_failures:
        raise ValueError(
            f"even_batches={even_batches!r} with on_error='skip' cannot keep every rank's "
            f"batch count equal when every rank takes strides of every shard (deal="
            f"{stream.deal!r}: shard sizes unknown, or fewer keys than ranks): a shard that "
            "fails on one rank only leaves that rank short, and synchronous training hangs. "
            "Give the ranks one shared cache_dir without cache_limit (a failure is recorded "
            "there, so every rank skips it), pass shard_sizes= (and as many keys as ranks), "
            "or on_error='raise' or ('retry', n)")


def _describe(loader: StreamLoader, remote: bool) -> None:
    """Tell the stats the settings ``stats.diagnose()`` bases its advice on."""
    stream, ctx = loader.stream, loader.ctx
    stream.stats.describe(
        producers=stream.producers, auto_producers=stream.auto_producers,
        remote=remote, prefetch=stream.prefetch,
        num_workers=1 if loader._tuned_workers else loader.num_workers,
        thread_pool=bool(loader.thread_pool),
        per_sample=not loader.vectorised, shards_on_ctx=loader.shards_on_ctx,
        contexts=len(ctx) if isinstance(ctx, list) else int(ctx is not None),
        pin_memory=bool(loader.pin_memory), shuffle_window=loader.shuffle_window,
        batch_size=loader.batch_size, memory_budget=stream.memory_budget)


def _tracker(provenance: Any) -> ProvenanceTracker | None:
    """``provenance=``: a tracker of each batch's origins, or None (off)."""
    if not isinstance(provenance, bool):
        raise TypeError(f"provenance must be True or False, got {provenance!r}")
    return ProvenanceTracker() if provenance else None


def _settings_saved(loader: StreamLoader) -> dict:
    """What decides the batches, stored in a state and checked on load."""
    stream = loader.stream
    settings = {"seed": stream.seed, "shuffle": stream.shuffle,
                "batch_size": loader.batch_size, "last_batch": loader.last_batch,
                "num_parts": stream.num_parts, "part_index": stream.part_index,
                "deal": stream.deal, "shuffle_window": loader.shuffle_window,
                "even_batches": loader.even_batches, "samples_per_epoch": loader.samples_per_epoch}
    context = stream.producer.context
    if context is not None:  # only then: states saved without context load as before
        settings["context_rows"] = context.rows
    return settings


def _saved_state(loader: StreamLoader) -> dict:
    """:meth:`StreamLoader.state_dict`: the chain's position, encoded with its settings."""
    state = loader._starts.current()
    position, dealer = state.position, loader.stream.dealer
    extra = remainder_fields(loader.stream, position.epoch, state.epoch) or {}
    if loader._job is not None:  # the ranks step together: merge_states compares them
        extra["job"] = loader._job
    return encode_state(state, _settings_saved(loader), dealer.epoch_keys(position.epoch)[2],
                        dealer.kept_key(position.epoch, position.unit), extra)


def _loaded_state(loader: StreamLoader, state: Mapping[str, Any]) -> LoaderState:
    """:meth:`StreamLoader.load_state_dict`: ``state`` decoded and checked against the
    loader's settings (a drawn seed takes the state's)."""
    stream = loader.stream
    settings = _settings_saved(loader)
    saved = state.get("settings") if isinstance(state, Mapping) else None
    seed = saved.get("seed") if isinstance(saved, Mapping) else None
    adopt = seed is not None and not stream.seed_given and _validate.is_int(seed)
    if adopt:
        settings["seed"] = seed
    decoded = load_any(state, settings, stream, lambda: decode_state(
        state, settings, loader.batch_size,
        lambda epoch: stream.dealer.epoch_keys(epoch, seed=settings["seed"])[2],
        stream.dealer.key_at))
    if adopt and seed is not None:
        stream.adopt_seed(int(seed))
    return decoded


def _signature_of_init(cls: type) -> inspect.Signature:
    """``cls.__init__``'s signature without ``self``: what ``inspect.signature(cls)`` (so
    ``help()``, Jupyter's Shift-Tab, IDEs) shows, where ``__new__``'s ``(*args, **kwargs)``
    would hide it. Annotations are evaluated where Python can (3.10+)."""
    try:
        signature = inspect.signature(cls.__init__, eval_str=True)  # type: ignore[misc]
    except (TypeError, NameError):  # Python 3.9: no eval_str, or no ``X | Y`` at run time
        signature = inspect.signature(cls.__init__)  # type: ignore[misc]
    return signature.replace(parameters=list(signature.parameters.values())[1:])


StreamLoader.__signature__ = _signature_of_init(StreamLoader)  # type: ignore[attr-defined]


def _held(loader: StreamLoader, batches: Generator[Any, None, None], legacy: bool
          ) -> Generator[Any, None, None]:
    """``batches``, holding ``loader`` while they run: ``for b in StreamLoader(...)`` and
    ``next(iter(StreamLoader(...)))`` refer to the loader only through its iterator, and the
    loader's finalizer (which closes its stream and workers) must wait for the last of the two
    to go. An iterator abandoned mid-epoch and dropped closes its pass, then lets go of the
    loader, which garbage collection then closes.

    The pipeline's arrays are legacy NDArrays; in numpy mode each batch is handed out as
    ``mx.np.ndarray`` views of them (no copy)."""
    if legacy:
        yield from batches
        return
    try:
        for batch in batches:
            yield as_numpy_batch(batch) if numpy_mode() else batch
    finally:
        batches.close()  # an abandoned pass cancels its producers now


def _check_even_batches(even_batches: Any, last_batch: str) -> None:
    if even_batches not in (True, False, "pad"):
        raise ValueError(f"even_batches must be True, False or 'pad', got {even_batches!r}")
    if even_batches is True and last_batch == "rollover":
        raise ValueError("even_batches=True delivers only full batches, so last_batch='rollover' "
                         "has nothing to roll over; use last_batch='keep' or 'discard'")
    if even_batches == "pad" and last_batch != "keep":
        raise ValueError(f"even_batches='pad' yields every sample once, the last batch padded; "
                         f"last_batch={last_batch!r} would drop or carry samples: use "
                         "last_batch='keep'")


def _stream_of(source: Source | ShardStream, given: dict[str, Any], even_batches: bool | str,
               samples_per_epoch: int | None, batch_size: int) -> tuple[ShardStream, bool]:
    """(the stream, whether the loader owns it): the one given, or one built from ``source``
    with the stream's arguments the loader was given."""
    if isinstance(source, ShardStream):
        if given:
            raise ValueError(f"{', '.join(given)} given to StreamLoader together with a "
                             "ShardStream: set them on the ShardStream instead")
        return source, False
    parts, index = resolve_parts(given.get("num_parts", 1), given.get("part_index", 0),
                                 kvstore=given.get("kvstore"))
    if parts > 1:
        known = _sizes_known(source, given) if even_batches else False
        deal, why = choose_deal(even_batches, samples_per_epoch is not None, known, parts,
                                _key_count(source), batch_size=batch_size,
                                sizes=_every_epoch_sizes(source, given) if known else None,
                                skip=given.get("on_error") == "skip")
        if deal != "shards":  # equal counts by construction: every rank takes its stride
            given.update(num_parts=parts, part_index=index, deal=deal)
            logger.info("%s: every rank produces every shard and takes its stride of the "
                        "samples (deal=%r)", why, deal)
    return ShardStream(source, **given), True


def _every_epoch_sizes(source: Source, given: Mapping[str, Any]) -> list[int] | None:
    """Every shard's size, where every epoch deals the same keys with the same sizes, known
    alike on every rank (declared, or the source's without a transform); None otherwise."""
    if not source.same_keys:
        return None
    sizes = ShardSizes(source, given.get("transform"), given.get("shard_sizes"), "shards", 1, 0,
                       lambda *args: (iter(()), True, None))
    keys, _ = source.keys_for_epoch(0)
    found = [sizes.agreed_size(key, 0) for key in keys]
    return None if any(n is None for n in found) else [int(n) for n in found if n is not None]


def _key_count(source: Source) -> int | None:
    """How many keys epoch 0 has, alike on every rank (None: an endless iterator)."""
    keys, finite = source.keys_for_epoch(0)
    return len(list(keys)) if finite else None


def _batch_path(loader: StreamLoader, retries: int) -> BatchPath:
    """The slice path (vectorised), or the sample path on the workers ``num_workers`` asks."""
    if loader.vectorised:
        home = loader.ctx if loader.shards_on_ctx else mx_arrays.batch_context(
            loader.pin_memory, loader.pin_device_id)
        if loader.num_workers:
            logger.info("num_workers=%d unused: without batchify_fn/sample_transform, batches "
                        "are slices of a shard prepared in the background", loader.num_workers)
        return SlicePath(home, mixed=loader.shuffle_window > 1, batch_size=loader.batch_size)
    workers: Workers = mx_workers.make_workers(
        loader.num_workers, bool(loader.thread_pool),
        {"sample_transform": loader.sample_transform, "batchify_fn": loader.batchify_fn,
         "sample_format": loader.sample_format}, retries,
        active=1 if loader._tuned_workers else None)
    return SamplePath(workers, loader.timeout, mx_arrays.batch_context(True, loader.pin_device_id)
                      if loader.pin_memory else None)


def _watch(loader: StreamLoader, tuner: Tuner, path: BatchPath) -> None:
    """Tell the tuner what the loader holds besides shards: rows of batches, at most the
    loop's batch and the next one (placed on ``ctx``, or copied by a per-sample path), and on
    the per-sample path the batches each worker makes ahead and its slots (one more); and
    the workers it may give batches to, when ``num_workers`` was not given."""
    tuner.set_window(loader.shuffle_window)
    per_worker = loader.batch_size * (mx_workers.PER_WORKER + 1)
    fixed = loader.num_workers if isinstance(path, SamplePath) and path.workers.depth > 1 else 0
    tuner.reserve_rows(2 * loader.batch_size
                       + (0 if loader._tuned_workers else fixed * per_worker))
    if loader._tuned_workers and isinstance(path, SamplePath):
        workers = path.workers
        assert isinstance(workers, mx_workers.ProcessWorkers)  # forked, one per core
        tuner.watch_workers(workers, lambda: path.wait_s, per_worker, loader._tuned_workers)
        path.on_batch = tuner.batch_taken


def _check_ctx(ctx: Any, shards_on_ctx: bool, vectorised: bool) -> Any:
    """``ctx`` checked: None, an MXNet context, or a non-empty list of them."""
    mx = import_mxnet()
    contexts = list(ctx) if isinstance(ctx, (list, tuple)) else [ctx]
    if ctx is not None and (not contexts or not all(isinstance(c, mx.Context) for c in contexts)):
        raise TypeError(f"ctx must be an MXNet context (mx.gpu(0), mx.cpu()) or a list of them, "
                        f"got {ctx!r}")
    if shards_on_ctx and (ctx is None or isinstance(ctx, (list, tuple)) or not vectorised):
        raise ValueError("shards_on_ctx=True copies whole shards to one ctx on the slice path: "
                         "pass one context as ctx=, and no batchify_fn/sample_transform")
    return list(ctx) if isinstance(ctx, (list, tuple)) else ctx


def _sizes_known(source: Source, given: Mapping[str, Any]) -> bool:
    """Whether every rank knows every shard's size ahead, and alike: ``shard_sizes=``, or sizes
    the source knows before anything is produced (local file headers, a cache filled ahead by
    ``gluon-stream generate``), with no transform to change them. (Shards cached by a job
    already running do not count: a rank starting later would see more than one starting
    earlier, and the two would deal the shards differently.) An endless iterator's epoch has
    no known end, whatever the sizes of its shards."""
    keys, finite = source.keys_for_epoch(0)
    if not finite:
        return False
    if given.get("shard_sizes") is not None:
        return True
    if given.get("transform") is not None or source.per_epoch:
        return False
    return all(source.known_size(key, 0) is not None for key in keys)
