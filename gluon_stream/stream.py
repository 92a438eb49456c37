"""ShardStream: shards in order, produced ahead of the consumer by a bounded thread pool.

Producer threads generate, load, transform and (when shuffling) permute each shard
while the consumer works on the current one; at most ``prefetch`` shards are ever
ahead of it, so at most ``prefetch + 1`` shards are held at once. Threads, not
processes: generation runs in external processes or in numpy code that releases the
GIL, and nothing has to be forked or pickled.

The contract with a consumer such as :class:`~gluon_stream.StreamLoader` is public:
:meth:`ShardStream.start_epoch` begins a pass (optionally with a ``prepare`` step that runs in
the producer threads, e.g. copying the shard into an NDArray) and returns an
:class:`EpochRun`, whose :meth:`~EpochRun.next_shard` hands out the shards in order.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import enum
import itertools
import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from ._utils import validate as _validate
from ._utils.closing import WAIT_SLICE_S, Closing
from ._utils.cores import usable_cores
from ._utils.lifecycle import check_owner, track
from ._utils.random import key_hash, seeded_rng
from ._mx import import_mxnet
from ._utils.distributed import resolve_parts
from .errors import InvalidState, LoaderClosed, SchemaMismatch, add_note
from ._utils.retry import ErrorPolicy, OnError, is_permanent
from ._utils.columns import names_of, normalize_arrays
from .sources import RawShard, Source
from ._pipeline.sizes import ShardSizes, part_rows
from ._pipeline.keys import KeyTape, part_endless, part_keys
from ._pipeline.producers import ProducerPool, Throttle
from ._pipeline.remainder import Remainder
from ._pipeline.tuning import DEFAULT_PREFETCH, START_PREFETCH, Limits, Tunable, Tuner
from .records import ShardRecord
from .stats import Stats

__all__ = ["EpochRun", "Prepare", "RunState", "Shard", "ShardStream"]

logger = logging.getLogger(__name__)

DEAL_MODES = ("shards", "samples", "strides")
_END = object()

#: ``prepare(arrays, order, what) -> arrays``: run in the producer thread after the transform,
#: it returns the shard's arrays in ``order`` (a permutation or a subset of the rows, or None)
#: in whatever form the consumer wants them (NDArrays, shared memory, ...); ``what`` names the
#: shard (key, file, epoch) for its error messages.
Prepare = Callable[[tuple, "np.ndarray | None", str], tuple]


@dataclass
class Shard:
    """One ready shard: its key, its position in the epoch and its arrays (samples first)."""

    key: Any
    epoch: int
    index: int
    arrays: tuple
    record: ShardRecord | None = field(repr=False, default=None)
    names: tuple[str, ...] | None = None  # the arrays' names (a dict's keys), if they have any
    full_size: int = -1  # the shard's samples before ranks took their part of them

    def __len__(self) -> int:
        return int(self.arrays[0].shape[0])

    @property
    def dataset(self) -> Any:
        """A ``gluon.data.ArrayDataset`` over the shard's arrays."""
        return import_mxnet().gluon.data.ArrayDataset(*self.arrays)


def schema_of(arrays: Sequence[Any]) -> list[tuple[str, tuple]]:
    """(dtype, trailing shape) of each array: what must agree between shards to batch them."""
    return [(np.dtype(a.dtype).str, tuple(a.shape[1:])) for a in arrays]


class ShardStream(Closing):
    """Iterate shards in order while the next ones are produced in the background.

    Args:
        source: A :class:`~gluon_stream.CommandSource`, ``FunctionSource`` or ``FileSource``.
            The stream owns it: closing the stream closes the source.
        transform: ``transform(raw) -> arrays`` per shard, run in a producer thread; ``raw`` is
            the ``.npy`` array or the tuple of ``.npz`` arrays. Returns an array, a tuple or a
            dict of arrays with a common first (sample) dimension.
        prefetch: Shards produced ahead of the one being consumed (0: none; default 2, or
            tuned within ``memory_budget`` when not given).
        producers: Shards produced at once. ``'auto'`` (default): one, and one more each time
            the consumer waits for a shard while every producer is busy and a core is free, up
            to ``min(prefetch, cores)``, counting the cores this process may use (its CPU
            affinity and cgroup quota: more have nothing ahead to make, or no core to run on);
            logged at INFO when it grows. An int fixes it; a ``concurrent.futures.Executor``
            (e.g. ``dask.distributed.Client.get_executor()``) generates shards elsewhere into a
            ``cache_dir`` both sides can see, loaded and transformed here, in order.
        shuffle: Shuffle the shard order (finite keys) and the samples within each shard,
            deterministically from ``(seed, epoch)``.
        seed: Seed for shuffling; None draws one (logged at INFO).
        on_error: Per shard: ``'raise'`` (default), ``'skip'`` (drop it with a WARNING and
            count it in stats), or ``('retry', n)``.
        schema: Expected ``[(dtype, trailing_shape), ...]`` per array; by default the first
            shard's schema is expected of all later ones.
        stats: A :class:`~gluon_stream.Stats` to record into (default: a new one).
        num_parts, part_index: Train on part ``part_index`` of ``num_parts`` (one per rank):
            each epoch's shards are dealt to the parts deterministically from ``(seed, epoch)``,
            differently each epoch. ``'auto'`` reads them from ``kvstore``, Horovod or the
            launcher's environment (see the multi-host guide).
        kvstore: An MXNet kvstore to read the rank from with ``'auto'``.
        shard_sizes: Samples per shard after ``transform``, for ``len()`` and ``even_batches``
            when headers cannot tell: ``{key: samples}``, ``fn(key) -> samples``, or one int for
            every shard.
        num_epochs: How many epochs will be run, if known: the shards of epoch ``num_epochs``
            are then not produced ahead while the last epoch ends (they would be thrown away).
        deal: How ``num_parts`` split an epoch. ``'shards'`` (default): each part produces its
            own share of the shards. ``'samples'``: every part produces every shard and takes its
            stride of each one's samples (after the shard's shuffle), ``n // num_parts`` apiece,
            so the parts hold equal counts without knowing any size ahead (dropping fewer than
            ``num_parts`` samples per shard); pair it with a shared ``cache_dir``.
            ``'strides'``: the same strides with nothing dropped (parts may differ by one
            sample per shard; ``even_batches='pad'`` evens them out with padding).
        generate_ahead: With a ``cache_dir``, producers that would otherwise sit idle generate
            up to this many shards beyond the ``prefetch`` window into the cache (disk, not
            memory), in key order: a shard that takes long to generate no longer holds up the
            ones after it, while batches keep their order and at most ``prefetch + 1`` shards
            are loaded. ``'auto'`` (default): ``2 * (prefetch + 1)`` with a cache, else 0, and
            with a ``cache_limit`` of N shards at most ``N - prefetch - 2`` (shards made ahead
            are not evicted before they are read).
        memory_budget: Bytes (or a string with a unit: ``"4GiB"``, ``"512MB"``) the stream may
            hold for data: shards produced or loading ahead, the copies producers make, and what
            a loader keeps in flight. Within it ``prefetch`` and ``producers`` (unless given)
            are tuned live from what is measured, each change logged at INFO with its reason
            and kept in :attr:`Stats.tuning`; a budget that cannot hold the shard in use plus
            one more raises :class:`~gluon_stream.MemoryBudgetTooSmall` (see
            :mod:`gluon_stream._pipeline.tuning` and the performance guide).

    Example:
        >>> from gluon_stream import FunctionSource
        >>> with ShardStream(FunctionSource(range(3), lambda k: np.arange(4) + 10 * k)) as s:
        ...     [(shard.key, len(shard)) for shard in s]
        [(0, 4), (1, 4), (2, 4)]
    """

    def __init__(self, source: Source, *, transform: Callable[[Any], Any] | None = None,
                 prefetch: int = _validate.UNSET, producers: int | str | cf.Executor = "auto",
                 shuffle: bool = False,
                 seed: int | None = None, on_error: OnError = "raise",
                 schema: Sequence[tuple[Any, Sequence[int]]] | None = None,
                 stats: Stats | None = None, num_parts: int | str = 1,
                 part_index: int | str = 0, kvstore: Any = None,
                 shard_sizes: Mapping[Any, int] | Callable[[Any], int] | int | None = None,
                 num_epochs: int | None = None, deal: str = "shards",
                 generate_ahead: int | str = "auto",
                 memory_budget: int | str | None = None) -> None:
        if not isinstance(source, Source):
            raise TypeError(f"source must be a CommandSource, FunctionSource or FileSource, got "
                            f"{type(source).__name__}")
        budget = (None if memory_budget is None
                  else _validate.byte_size("memory_budget", memory_budget))
        fixed_prefetch = _validate.is_set(prefetch)
        prefetch = _validate.integer("prefetch", prefetch if fixed_prefetch else (
            DEFAULT_PREFETCH if budget is None else START_PREFETCH), minimum=0)  # starts low
        self._remote = producers if isinstance(producers, cf.Executor) else None
        self.auto_producers = producers == "auto"
        if self._remote is not None:  # local threads only wait for, load and transform shards
            throttle = Throttle(prefetch + 1, prefetch + 1)
        elif self.auto_producers and budget is not None:  # the tuner sets the count
            throttle = Throttle(1, usable_cores())
        elif self.auto_producers:
            throttle = Throttle(1, max(1, min(prefetch, usable_cores())))
        else:
            producers = _validate.integer(
                "producers", producers, minimum=1,
                hint="'auto', or a concurrent.futures.Executor")
            throttle = Throttle(producers, producers)
        _validate.callable_or_none("transform", transform)
        self.source = source
        self.transform = transform
        self.prefetch = prefetch
        self.shuffle = bool(shuffle)
        self.num_parts, self.part_index = resolve_parts(num_parts, part_index, kvstore=kvstore)
        self.deal = _validate.choice("deal", deal, DEAL_MODES)
        if seed is None and self.shuffle and self.num_parts > 1:
            raise ValueError("shuffle=True with num_parts > 1 needs an explicit seed, the same on "
                             "every rank, so that the ranks agree on who gets which shard")
        self.seed_given = seed is not None
        if seed is None and self.num_parts == 1:  # several parts deal shards with seed 0
            seed = int(np.random.SeedSequence().generate_state(1)[0]) % (2 ** 31)
            (logger.info if self.shuffle else logger.debug)(
                "no seed given: using seed=%d (shuffle order and per-sample randomness)", seed)
        self.seed = 0 if seed is None else _validate.integer("seed", seed)
        self.error_policy = ErrorPolicy.parse(on_error)
        self._schema = ([(np.dtype(d).str, tuple(s)) for d, s in schema]
                        if schema is not None else None)
        self.stats = stats if stats is not None else Stats()
        self.epoch = 0
        self._next_run: EpochRun | None = None
        self.keep_keys = False  # keep an endless iterator's keys (samples_per_epoch restarts)
        self._tapes: dict[tuple[int, int], KeyTape] = {}
        #: an elastic resume: the rest of the interrupted epoch, read in place of its keys
        self.remainder: Remainder | None = None
        #: what is known of the shards' sizes without producing them (len, even_batches)
        self.sizes = ShardSizes(source, transform, shard_sizes, self.deal, self.num_parts,
                                self.part_index, self.epoch_keys, self.remainder_of)
        caches = bool(getattr(source, "cached", False)) and self._remote is None
        self._generate_auto = generate_ahead == "auto" and caches
        if generate_ahead == "auto":
            self.generate_ahead = self._auto_generate_ahead(prefetch) if caches else 0
        else:
            self.generate_ahead = _validate.integer("generate_ahead", generate_ahead, minimum=0,
                                                    hint="or 'auto'")
            if self.generate_ahead and not caches:
                raise ValueError(f"generate_ahead={generate_ahead} generates shards into a cache "
                                 "while they wait to be loaded: it needs a source with a "
                                 "cache_dir, and local producers")
        self.num_epochs = (None if num_epochs is None
                           else _validate.integer("num_epochs", num_epochs, minimum=1))
        self._res = ProducerPool(source, throttle)
        self.memory_budget = budget
        target: Tunable = self
        self.tuner = None if budget is None else Tuner(
            target, Limits(budget, throttle.bound, fixed_prefetch=fixed_prefetch,
                           fixed_producers=not self.auto_producers),
            lambda: self.stats.clock() - self.stats.origin, self.stats.add_tuning)
        self._finalizer = weakref.finalize(self, self._res.close)
        track(self, self._finalizer)

    def _auto_generate_ahead(self, prefetch: int) -> int:
        """``generate_ahead='auto'`` for ``prefetch``: two windows' worth, within the
        ``cache_limit``."""
        ahead = 2 * (prefetch + 1)
        room = self.source.cache_room
        if room is not None:  # shards made ahead must not be evicted before they are read
            ahead = max(0, min(ahead, room - prefetch - 2))
        return ahead

    # -- configuration ------------------------------------------------------------------
    @property
    def producers(self) -> int:
        """Shards produced at once now (with ``'auto'``, it grows up to its bound)."""
        return self._res.throttle.active

    def set_prefetch(self, prefetch: int) -> None:
        """Produce ``prefetch`` shards ahead from the next shard on (the ``memory_budget``
        tuner; shards already ahead beyond it are handed out as usual). ``generate_ahead='auto'``
        follows it."""
        self.prefetch = _validate.integer("prefetch", prefetch, minimum=0)
        if self._generate_auto:
            self.generate_ahead = self._auto_generate_ahead(self.prefetch)

    def set_producers(self, producers: int) -> None:
        """Produce ``producers`` shards at once (the ``memory_budget`` tuner), within the
        producer threads the stream has."""
        self._res.throttle.set_active(_validate.integer("producers", producers, minimum=1))

    def _waited(self, key: Any, queued: int = 0) -> None:
        """The consumer had to wait for shard ``key``: with ``'auto'``, add a producer if every
        producer is busy (running, or about to run one of the ``queued`` shards) and a core
        is free (the loop, waiting, uses none). With a ``memory_budget`` the tuner decides,
        from this and the budget."""
        throttle = self._res.throttle
        if self.tuner is not None:
            self.tuner.waited(throttle.running + queued >= throttle.active)
            return
        if not self.auto_producers or throttle.running + queued < throttle.active:
            return
        if throttle.grow():
            logger.info("producers='auto': %d producers (the loop waited for shard %r while "
                        "every producer was busy)", throttle.active, key)

    @property
    def on_error(self) -> str:
        """``'raise'``, ``'skip'`` or ``'retry'`` (see :attr:`error_policy` for the count)."""
        return self.error_policy.mode

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch the next iteration produces (its keys, shuffle and cache entries)."""
        self.epoch = _validate.integer("epoch", epoch, minimum=0)

    @property
    def closed(self) -> bool:
        return self._res.closed.is_set()

    def check_open(self) -> None:
        check_owner(self, "ShardStream")
        if self.closed:
            raise LoaderClosed("this ShardStream/StreamLoader is closed; create a new one")

    def adopt_seed(self, seed: int) -> None:
        """Take ``seed`` (a resumed state's) in place of the one drawn for ``seed=None``."""
        if self.seed_given:
            raise ValueError(f"this stream was given seed={self.seed}; it keeps it")
        self.seed = _validate.integer("seed", seed)
        self._drop_runs()

    def set_remainder(self, remainder: Remainder | None) -> None:
        """Read ``remainder`` in place of its epoch's keys (an elastic resume; None: the keys)."""
        if remainder is not self.remainder:
            self.remainder = remainder
            self._drop_runs()

    def dealt_keys(self, epoch: int, parts: int, part: int, deal: str,
                   seed: int | None = None) -> list:
        """Part ``part`` of ``parts``' shard order in ``epoch`` as a job of ``parts`` ranks dealt
        it (with this stream's keys and shuffle; ``seed``: another seed than the stream's)."""
        keys, finite = self.source.keys_for_epoch(epoch)
        if not finite:
            raise InvalidState("field 'keys': the state was saved reading a key list, this "
                               "loader's keys are an endless iterator (the two deal their "
                               "shards differently); build it with the same keys")
        return part_keys(list(keys), self.seed if seed is None else seed, epoch, parts, part,
                         self.shuffle, deal)

    def endless_keys(self, epoch: int) -> Iterator[Any]:
        """An endless iterator's keys of ``epoch``, every part's (an elastic resume deals
        them again); InvalidState for a key list."""
        keys, finite = self.source.keys_for_epoch(epoch)
        if finite:
            raise InvalidState("field 'keys': the state was saved reading an endless key "
                               "iterator, this loader's keys are a list; build it with the "
                               "same keys")
        return iter(keys)

    def _drop_runs(self) -> None:
        self._next_run = None
        for run in list(self._res.runs):  # shards made ahead in another order
            run.cancel()

    def epoch_keys(self, epoch: int, part_index: int | None = None, seed: int | None = None,
                   start: int = 0) -> tuple[Iterator[Any], bool, list | None]:
        """(keys iterator from position ``start``, finite, key list or None) of one part in this
        epoch's shard order (``seed``: with another seed than the stream's)."""
        part = self.part_index if part_index is None else part_index
        seed = self.seed if seed is None else seed
        remainder = self.remainder_of(epoch)
        if remainder is not None:  # every part reads every piece (its stride of their rows)
            pieces = remainder.keys
            if remainder.tail is None:
                return iter(pieces[start:]), True, pieces
            # endless keys: then the iterator's keys after the pieces, as this job deals them
            tail = remainder.tail_keys(self.num_parts, part, self.deal)
            tail = itertools.islice(tail, max(0, start - len(pieces)), None)
            return itertools.chain(pieces[start:], tail), False, None
        if self.keep_keys and (epoch, part) in self._tapes:
            return self._tapes[(epoch, part)].read(start), False, None
        keys, finite = self.source.keys_for_epoch(epoch)
        if not finite:
            keys = part_endless(keys, self.num_parts, part, self.deal)
            if self.keep_keys:  # a pass may start again at a later epoch's boundary
                tape = self._tapes[(epoch, part)] = KeyTape(keys)
                return tape.read(start), False, None
            return itertools.islice(keys, start, None), False, None
        keys = part_keys(list(keys), seed, epoch, self.num_parts, part, self.shuffle, self.deal)
        return iter(keys[start:]), True, keys

    def key_at(self, epoch: int, index: int) -> tuple[Any, str | None] | None:
        """An endless iterator's keys kept for passes that start again (``keep_keys``): this
        part's key ``index`` of pass ``epoch``, drawn up to it as a resumed pass draws them:
        ``(key, None)``, or ``(None, why there is none)``; None for a key list, or keys not kept."""
        if not self.keep_keys or self.epoch_keys(epoch)[1]:
            return None
        return self._tapes[(epoch, self.part_index)].key_at(index)

    def kept_key(self, epoch: int, index: int) -> tuple[int, Any] | None:
        """(position, key) of the last key kept at or before ``index`` for this part's pass
        ``epoch`` of an endless iterator, without drawing any; None: none kept."""
        tape = self._tapes.get((epoch, self.part_index)) if self.keep_keys else None
        return tape.kept(index) if tape is not None else None

    def forget_keys(self, epoch: int, before: int) -> None:
        """The keys of an endless iterator kept for ``epoch`` before position ``before`` are
        needed no more (no pass starts again before it)."""
        tape = self._tapes.get((epoch, self.part_index))
        if tape is not None:
            tape.forget(before)

    def remainder_of(self, epoch: int) -> Remainder | None:
        """The remainder read in place of ``epoch``'s keys (an elastic resume), if any."""
        remainder = self.remainder
        return remainder if remainder is not None and remainder.epoch == epoch else None

    def made_epoch(self, epoch: int, index: int) -> int:
        """The epoch whose shard is at position ``index`` of ``epoch`` (a remainder's pieces
        may be of the epoch before: samples it rolled over)."""
        remainder = self.remainder_of(epoch)
        return remainder.pieces[index].epoch if remainder is not None \
            and remainder.is_piece(index) else epoch

    def row_order(self, key: Any, epoch: int, length: int, index: int = -1
                  ) -> np.ndarray | None:
        """The rows of a shard this part reads, in order (None: all of them, as they are);
        ``index``: its position in the epoch (a remainder's piece says which rows are left)."""
        remainder = self.remainder_of(epoch)
        if remainder is not None and remainder.is_piece(index):  # else: an endless tail's key
            made = remainder.pieces[index].epoch
            own = self.shard_order(key, made, length)
            return remainder.rows(index, np.arange(length) if own is None else own,
                                  self.num_parts, self.part_index, self.deal,
                                  self.sizes.rows_before(epoch, index))
        order = self.shard_order(key, epoch, length)
        if self.deal in ("samples", "strides") and self.num_parts > 1:
            rows = np.arange(length) if order is None else order
            order = part_rows(rows, self.num_parts, self.part_index, self.deal)
        return order

    def shard_order(self, key: Any, epoch: int, length: int) -> np.ndarray | None:
        """A shard's own row order in ``epoch``, before parts take theirs (None: as it is)."""
        if self.shuffle and length > 1:
            return seeded_rng(self.seed, epoch, key_hash(key)).permutation(length)
        return None

    # -- iteration ----------------------------------------------------------------------
    def __iter__(self) -> Iterator[Shard]:
        run = self.start_epoch()
        try:
            while True:
                shard = run.next_shard()
                if shard is None:
                    break
                if shard.record is not None and shard.record.source is not None:
                    self.stats.add_delivered({shard.record.source: len(shard)})  # whole shards
                yield shard
                del shard
        finally:
            run.cancel()

    def start_epoch(self, skip: int = 0, prepare: Prepare | None = None,
                    skipped: Sequence[int] = (), reuse: "EpochRun | None" = None) -> "EpochRun":
        """Begin producing the current epoch after ``skip`` shards; cancels any unfinished pass.

        ``skipped``: positions of shards that failed before (``on_error='skip'``, recorded in a
        resumed state): they count as skipped again without being produced, so a resume sees
        the epoch the interrupted pass saw. ``reuse``: a pass of this epoch that stopped at
        ``skip`` (an epoch of ``samples_per_epoch`` ended there): it goes on, with the shards it
        produced ahead, instead of a new one.

        ``prepare(arrays, order, what)``, if given, runs in the producer threads after the transform
        and returns the shard's arrays in ``order`` in the form the consumer wants; without it
        the rows are permuted with numpy. The same ``prepare`` is used for the next epoch's
        shards produced ahead.
        """
        self.check_open()
        epoch = self.epoch
        self.epoch += 1  # without set_epoch, the next pass is the next epoch
        if reuse is not None and reuse.epoch == epoch and reuse.index_next() == skip \
                and not reuse.cancelled and reuse.prepare is prepare and not skipped:
            for old in list(self._res.runs):
                if old is not reuse and old is not self._next_run:
                    old.cancel()
            return reuse
        ahead, self._next_run = self._next_run, None
        for old in list(self._res.runs):
            if old is not ahead:
                old.cancel()
        if (ahead is not None and ahead.epoch == epoch and not skip and not skipped
                and not ahead.cancelled and ahead.prepare is prepare):
            return ahead  # its first shards were produced while the last epoch ended
        if ahead is not None:
            ahead.cancel()
        return self._new_run(epoch, skip, prepare, skipped)

    def _new_run(self, epoch: int, skip: int, prepare: Prepare | None,
                 skipped: Sequence[int] = ()) -> "EpochRun":
        run = EpochRun(self, epoch, skip, prepare, skipped)
        self._res.runs.add(run)
        return run

    def _run_ahead(self, epoch: int, prepare: Prepare | None) -> "EpochRun":
        """The pass of the epoch after this one, started early to hide its first shards' cost."""
        ahead = self._next_run
        if ahead is None or ahead.epoch != epoch or ahead.prepare is not prepare:
            if ahead is not None:
                ahead.cancel()
            ahead = self._next_run = self._new_run(epoch, 0, prepare)
        return ahead

    def produce_now(self, key: Any, epoch: int, prepare: Prepare | None = None,
                    index: int = -1, whole: bool = False) -> Shard:
        """Produce one shard in the calling thread, exactly as the producers would (for resume;
        ``index``: its position in the epoch, where a remainder's piece is read; ``whole``:
        every row, in the file's order, not this part's rows in its order)."""
        self.check_open()
        return self._make(key, epoch, index, None, prepare, whole)

    def _produce(self, key: Any, epoch: int, index: int, run: "EpochRun | None",
                 prepare: Prepare | None) -> Shard:
        """Runs in a producer thread: generate/load, transform, shuffle, prepare."""
        if run is not None and run.cancelled:
            raise LoaderClosed("epoch pass cancelled")
        if run is None:  # produce_now: in the caller's thread, outside the producers' count
            return self._make(key, epoch, index, run, prepare)
        generated_s = run.generated(index)  # made ahead into the cache: only loading is left
        with self._res.throttle:
            shard = self._make(key, epoch, index, run, prepare)
        if generated_s and shard.record is not None:
            shard.record.generate_s += generated_s
            shard.record.cache_hit = False
        return shard

    def _generate(self, key: Any, epoch: int, run: "EpochRun") -> float:
        """Runs in a producer thread: make a shard in the cache without loading it (it waits
        there, on disk, for its turn in the ``prefetch`` window); the seconds it took, or 0
        when it was cached already."""
        with self._res.throttle:
            if run.cancelled:
                raise LoaderClosed("epoch pass cancelled")
            lane = threading.current_thread().name
            t0 = self.stats.clock()
            _, hit, seconds = self.source.ensure_file(key, epoch)
            if hit:
                return 0.0
            self.stats.add_span(lane, "generate", t0, t0 + seconds, key)
            return seconds

    def _make(self, key: Any, epoch: int, index: int, run: "EpochRun | None",
              prepare: Prepare | None, whole: bool = False) -> Shard:
        if run is not None and run.cancelled:
            raise LoaderClosed("epoch pass cancelled")
        lane = threading.current_thread().name
        clock = self.stats.clock
        t0 = clock()
        made = self.made_epoch(epoch, index)
        raw: RawShard = (self.source.produce(key, made) if self._remote is None
                         else self.source.produce(key, made, executor=self._remote))
        t1 = clock()
        arrays = raw.arrays
        if self.transform is not None:
            arg = arrays[0] if len(arrays) == 1 else arrays
            try:
                value = self.transform(arg)
            except Exception as exc:
                add_note(exc, f"gluon_stream: raised by transform on shard {key!r} "
                              f"(file {raw.path!r}, epoch {epoch})")
                raise
            arrays = normalize_arrays(value, what=f"transform output of shard {key!r}")
        full_size = len(arrays[0])
        nbytes = sum(int(getattr(a, "nbytes", 0)) for a in arrays)
        order = None if whole else self.row_order(key, epoch, full_size, index)
        if run is not None and run.cancelled:
            raise LoaderClosed("epoch pass cancelled")
        names = names_of(arrays)
        if prepare is not None:  # it applies the order while copying (no extra copy)
            arrays = prepare(arrays, order, f"shard {key!r} (file {raw.path!r}, epoch {epoch})")
        elif order is not None:
            arrays = tuple(a[order] for a in arrays)  # not np.take: it copies a strided input
        shard = Shard(key, epoch, index, arrays, names=names, full_size=full_size)
        t2 = clock()
        gen_end = t0 + raw.generate_s
        load_end = gen_end + raw.load_s
        self.stats.add_span(lane, "generate", t0, gen_end, key)
        self.stats.add_span(lane, "load", gen_end, load_end, key)
        self.stats.add_span(lane, "transform", max(load_end, t1), t2, key)
        shard.record = ShardRecord(key, epoch, len(shard), raw.cache_hit, raw.generate_s,
                                   raw.load_s, t2 - t1, lane, source=raw.source, nbytes=nbytes)
        return shard

    def _check_schema(self, shard: Shard) -> None:
        found = schema_of(shard.arrays)
        if self._schema is None:
            self._schema = found
        elif found != self._schema:
            raise SchemaMismatch(
                f"shard {shard.key!r} (epoch {shard.epoch}) has arrays {found} as "
                f"[(dtype, trailing shape)], but {self._schema} was expected (from the first "
                "shard or schema=); every shard must batch together")

    # -- lifecycle ------------------------------------------------------------------------
    def close(self) -> None:
        """Stop producers, kill running generators and release everything; idempotent."""
        self._finalizer()


class RunState(enum.IntEnum):
    """Where an :class:`EpochRun` is in its life: it submits shards while keys are left
    (``PRODUCING``), then hands out what it submitted (``EXHAUSTED``: no key left, or the key
    iterator failed), until its consumer is done or a newer pass replaces it (``CANCELLED``:
    queued work dropped, running producers finish and are ignored). It only moves forward."""

    PRODUCING = 0
    EXHAUSTED = 1
    CANCELLED = 2


class EpochRun:
    """One pass over an epoch's keys: a window of futures, handed out in order.

    Attributes:
        epoch: The epoch this pass produces.
        index: Position in the epoch of the next shard to be submitted.
        skipped: Shards dropped by ``on_error='skip'`` so far.
        last_wait_s: How long the last :meth:`next_shard` waited for its shard to be produced.
        max_pending: The most shards in flight at once (queued, being produced, or ready and
            not yet handed out); None: ``prefetch + 1``. A consumer that keeps several shards
            it was handed (a shuffle window) lowers it, so that what it holds and what is in
            flight stay within its budget; at least 1, so production always overlaps.
    """

    def __init__(self, stream: ShardStream, epoch: int, skip: int = 0,
                 prepare: Prepare | None = None, skipped: Sequence[int] = ()) -> None:
        self.stream = stream
        self.epoch = epoch
        self.prepare = prepare
        # from ``skip`` on: a resume does not produce the shards before it again
        self.keys, self.finite, self.key_list = stream.epoch_keys(epoch, start=skip)
        self.pending: collections.deque = collections.deque()
        self.index = skip
        self.state = RunState.PRODUCING
        self.skipped = 0
        self.skipped_at: list[int] = []  # positions of the shards skipped, in order
        self._preskipped = frozenset(skipped)
        self.key_error: BaseException | None = None
        self.last_wait_s = 0.0
        self.waits = 0  # times a shard was asked for before it was produced
        self.max_pending: int | None = None
        self._handed = False  # a shard was handed out: the consumer holds one (see _window)
        self._lookahead: collections.deque = collections.deque()  # (key, index) drawn early
        self._ahead: dict[int, cf.Future] = {}  # index -> generation into the cache
        # the consumer fills the window; producers finishing a shard start generations ahead
        self._lock = threading.RLock()

    def index_next(self) -> int:
        """The position of the shard :meth:`next_shard` hands out next."""
        with self._lock:
            return self.pending[0][1] if self.pending else self.index

    def push_back(self, shard: Shard) -> None:
        """Hand ``shard`` out again first (an epoch stopped inside it; the next goes on)."""
        done: cf.Future = cf.Future()
        done.set_result(shard)
        with self._lock:
            self.pending.appendleft((shard.key, shard.index, done))

    @property
    def cancelled(self) -> bool:
        """The pass was cancelled: it hands out nothing more."""
        return self.state is RunState.CANCELLED

    @property
    def exhausted(self) -> bool:
        """Every key is submitted (or the keys failed): nothing more will be produced."""
        return self.state >= RunState.EXHAUSTED

    def _advance(self, state: RunState) -> None:
        self.state = max(self.state, state)  # forward only: a cancelled pass stays cancelled

    def _next_key(self) -> Any:
        """The next (key, index) in order, or _END; a failing key iterator ends the keys."""
        if self._lookahead:
            return self._lookahead.popleft()
        return self._draw_key()

    def _draw_key(self) -> Any:
        """The key after those drawn already (and looked ahead at), with its index, or _END."""
        if self.key_error is not None:
            return _END
        try:
            key = next(self.keys, _END)
        except Exception as exc:  # the keys' own iterator failed: the shards drawn come first
            add_note(exc, f"gluon_stream: raised by the keys of epoch {self.epoch} after "
                          f"{self.index + len(self._lookahead)} key(s); the shards of those "
                          "were delivered first")
            self.key_error = exc
            return _END
        if key is _END:
            return _END
        return key, self.index + len(self._lookahead)

    def generated(self, index: int) -> float:
        """Wait for shard ``index``'s generation ahead, if one runs: its seconds (0: none
        ran; a generation not yet started is dropped and the shard made as usual). Its
        failure is raised here, where the shard's error policy applies."""
        fut = self._ahead.pop(index, None)  # one pop: atomic, no lock to wait for
        if fut is None or fut.cancel():
            return 0.0
        return fut.result()

    def _generate_ahead(self, _: Any = None) -> None:
        """Keep idle producers generating the shards after the window into the cache (called
        when the window is filled and whenever a producer finishes)."""
        stream = self.stream
        if not stream.generate_ahead or self.cancelled or stream.closed:
            return
        with self._lock:
            self._start_generation()

    def _start_generation(self, busy: int = 0) -> None:
        """Submit one generation ahead if a producer is idle (``busy``: shards an earlier
        pass has queued, which come first)."""
        stream = self.stream
        depth = stream.generate_ahead
        throttle = stream._res.throttle
        if throttle.running + self._queued() + busy >= throttle.active:
            return  # no producer is idle: the window's shards come first
        ended = False
        while len(self._lookahead) < depth:
            nxt = self._draw_key()
            if nxt is _END:
                ended = True
                break
            self._lookahead.append(nxt)
        for key, index in self._lookahead:
            if index not in self._ahead and index not in self._preskipped:
                fut = stream._res.executor.submit(stream._generate, key,
                                                  stream.made_epoch(self.epoch, index), self)
                self._ahead[index] = fut
                fut.add_done_callback(self._generate_ahead)
                return  # one at a time: the next call sees whether a producer is still idle
        if ended and self.finite and not self.cancelled and not self._last_epoch() \
                and self.stream._next_run is not self:  # a pass made ahead stops at its own
            self._generate_next_epoch()

    def _last_epoch(self) -> bool:
        return self.stream.num_epochs is not None and self.epoch + 1 >= self.stream.num_epochs

    def _generate_next_epoch(self) -> None:
        """Every key of this pass is made or under way, and a producer is idle: it generates
        the next epoch's first shards into the cache (disk, not memory: a shuffle window's
        tail keeps its shards, and the next epoch starts on shards already made)."""
        nxt = self._next_epoch_run("generating")
        if nxt is None:
            return
        with nxt._lock:
            nxt._start_generation(busy=self._queued())

    def _next_epoch_run(self, doing: str) -> "EpochRun | None":
        """The stream's pass for the next epoch, begun early; None if its keys failed (they
        raise again when that epoch starts)."""
        try:
            return self.stream._run_ahead(self.epoch + 1, self.prepare)
        except Exception as exc:
            logger.debug("not %s epoch %d early: %s: %s", doing, self.epoch + 1,
                         type(exc).__name__, exc)
            return None

    def _submit(self, key: Any, index: int) -> cf.Future:
        fut = self.stream._res.executor.submit(self.stream._produce, key, self.epoch, index,
                                               self, self.prepare)
        if self.stream.generate_ahead:
            fut.add_done_callback(self._generate_ahead)
        return fut

    def _fill(self, depth: int, ahead: bool = True) -> None:
        with self._lock:
            self._fill_locked(depth, ahead)

    def _fill_locked(self, depth: int, ahead: bool) -> None:
        if self.max_pending is not None:
            depth = min(depth, max(1, self.max_pending))
        while len(self.pending) < depth and not self.exhausted:
            nxt = self._next_key()
            if nxt is _END:
                self._advance(RunState.EXHAUSTED)
                break
            key, index = nxt
            self.index = index + 1  # first: a callback of the submit below draws the next key
            if index in self._preskipped:  # failed before the resume: skipped again
                logger.debug("shard %r (epoch %d) stays skipped, as before the resume", key,
                             self.epoch)
                self.skipped += 1
                self.skipped_at.append(index)
            else:
                self.pending.append((key, index, self._submit(key, index)))
        if ahead and self.exhausted and self.finite and len(self.pending) < depth \
                and not self.cancelled and not self._last_epoch():
            # the window has room: start on the next epoch (the one set_epoch(e + 1) or the
            # next pass will ask for); a different epoch discards it
            nxt = self._next_epoch_run("starting")
            if nxt is None:
                return
            nxt._fill(depth - len(self.pending), ahead=False)
        if ahead:
            self._generate_ahead()

    def start(self) -> None:
        """Submit the first window of shards now (otherwise the first ``next_shard`` does)."""
        self._fill(self.stream.prefetch + 1)

    def _window(self) -> int:
        """Shards to keep submitted: ``prefetch + 1`` before the first is handed out, then
        ``prefetch`` (at least the next one), before a shard is handed out as after: the
        shard in use is alive until the next is handed out, so filling ``prefetch + 1`` while
        the consumer held one kept a shard more than the memory bound counts."""
        prefetch = self.stream.prefetch
        return max(1, prefetch) if self._handed else prefetch + 1

    def ready(self) -> bool:
        """Whether :meth:`next_shard` would return without waiting for a producer."""
        if self.cancelled or self.stream.closed:
            return True
        self._fill(self._window())
        return not self.pending or self.pending[0][2].done()

    def has_shard(self) -> bool:
        """Whether the next shard is produced and good: :meth:`next_shard` hands it out at once."""
        if self.cancelled or self.stream.closed:
            return False
        self._fill(self.stream.prefetch + 1)
        if not self.pending:
            return False
        fut = self.pending[0][2]
        return fut.done() and not fut.cancelled() and fut.exception() is None

    def _queued(self) -> int:
        """Shards of this pass submitted to the producers and not started yet."""
        with self._lock:
            futures = [fut for _, _, fut in self.pending] + list(self._ahead.values())
        return sum(1 for fut in futures if not (fut.running() or fut.done()))

    def ready_ahead(self) -> int:
        """Shards ahead of the consumer that are already produced."""
        with self._lock:
            return sum(1 for _, _, fut in self.pending if fut.done())

    def next_shard(self) -> Shard | None:
        """The next shard in order, or None at the end of the epoch."""
        stream = self.stream
        self.last_wait_s = 0.0  # summed over retries; 0 at the end (nothing was waited for)
        while True:
            stream.check_open()
            if self.cancelled:
                raise LoaderClosed("this epoch pass was replaced by a newer one")
            self._fill(self._window())
            if not self.pending:
                if self.key_error is not None:
                    error, self.key_error = self.key_error, None
                    raise error
                return None
            with self._lock:
                key, index, fut = self.pending.popleft()
            self._fill(stream.prefetch)
            shard = self._wait(key, index, fut)
            if shard is not None:
                self._handed = True
                return shard

    def _wait(self, key: Any, index: int, fut: cf.Future) -> Shard | None:
        stream = self.stream
        policy = stream.error_policy
        attempts = 0
        while True:
            try:
                shard = self._result(fut, key)
                stream._check_schema(shard)
            except (LoaderClosed, KeyboardInterrupt, cf.CancelledError):
                raise
            except Exception as exc:
                summary = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                if policy.mode == "retry" and attempts < policy.retries and not is_permanent(exc):
                    attempts += 1
                    logger.warning("shard %r failed (%s); retry %d/%d", key, summary, attempts,
                                   policy.retries)
                    logger.debug("shard %r failure in full: %s", key, exc)
                    fut = self._submit(key, index)
                    continue
                if policy.mode == "skip":
                    logger.warning("skipping shard %r (epoch %d): %s", key, self.epoch, summary)
                    logger.debug("shard %r failure in full: %s", key, exc)
                    self.skipped += 1
                    self.skipped_at.append(index)
                    stream.stats.add_shard(ShardRecord(key, self.epoch,
                                                       error=f"{type(exc).__name__}: {exc}"))
                    return None
                raise
            record = shard.record
            assert record is not None  # _make records every shard it makes
            stream.stats.add_shard(record)
            if stream.tuner is not None:  # may refuse the shard: before any batch of it
                stream.tuner.shard_ready(key, record.nbytes, record.samples, self.last_wait_s,
                                         record.generate_s + record.load_s + record.transform_s,
                                         self.epoch)
                self._fill(stream.prefetch)  # a prefetch just raised fills the window now
            stream.sizes.remember(key, stream.made_epoch(self.epoch, index), shard.full_size)
            expected = stream.sizes.shard_size(key, self.epoch) if stream.sizes.declared(key) \
                is not None and stream.remainder_of(self.epoch) is None else None
            if expected is not None and expected != len(shard):
                logger.warning(
                    "shard %r (epoch %d) gives this part %d samples after transform, but "
                    "shard_sizes declares %d: batch counts (len(), even_batches) follow the "
                    "declared sizes on every rank, and a part left short repeats its last batch. "
                    "Fix shard_sizes", key, self.epoch, len(shard), expected)
            logger.info("shard %r ready: %d samples (generate %.2f s, load %.2f s, "
                        "transform %.2f s%s)", key, len(shard), record.generate_s,
                        record.load_s, record.transform_s, ", cached" if record.cache_hit else "")
            return shard

    def _result(self, fut: cf.Future, key: Any = None) -> Shard:
        clock = self.stream.stats.clock
        start = clock()
        try:
            return self._poll(fut, key)
        finally:
            self.last_wait_s += clock() - start

    def _poll(self, fut: cf.Future, key: Any = None) -> Shard:
        # cf.wait, not result(timeout=): since Python 3.11 cf.TimeoutError is the built-in
        # TimeoutError, so a shard that failed with ShardTimeout would look 'not ready yet'
        if not fut.done():
            self.waits += 1
            self.stream._waited(key, self._queued() + (not fut.running()))
        while not cf.wait([fut], timeout=WAIT_SLICE_S).done:
            self.stream.check_open()
            if self.cancelled:
                raise LoaderClosed("this epoch pass was cancelled")
        return fut.result()

    def cancel(self) -> None:
        """Drop queued work; running producers finish (populating caches) and are ignored."""
        self._advance(RunState.CANCELLED)
        with self._lock:
            while self.pending:
                _, _, fut = self.pending.popleft()
                fut.cancel()
            for fut in self._ahead.values():
                fut.cancel()
            self._ahead.clear()
