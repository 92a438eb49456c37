"""ShardStream: shards in order, produced ahead of the consumer by a bounded thread pool.

Producer threads generate, load, transform and (when shuffling) permute each shard
while the consumer works on the current one; at most ``prefetch`` shards are ever
ahead of it, so at most ``prefetch + 1`` shards are held at once. Threads, not
processes: generation runs in external processes or in numpy code that releases the
GIL, and nothing has to be forked or pickled.

The contract with a consumer such as :class:`~gluon_stream.StreamLoader` is public:
:meth:`ShardStream.start_epoch` begins a pass (optionally with a ``prepare`` step that runs in
the producer threads, e.g. copying the shard into an NDArray) and returns an
:class:`EpochRun`, whose :meth:`~EpochRun.next_shard` hands out the shards in order. The pass
lives in :mod:`gluon_stream._pipeline.run` and drives the stream through the public methods
of its :class:`~gluon_stream._pipeline.run.ShardMaker` contract; ``EpochRun``, ``RunState``
and ``Shard`` are importable from here as before.
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import itertools
import logging
import weakref
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from ._pipeline.admission import Admission, MemoryGate
from ._pipeline.context import ContextBreak, context_rows_of
from ._pipeline.keys import KeyTape, part_endless, part_keys
from ._pipeline.offsets import Deferred
from ._pipeline.producers import ProducerPool, Throttle
from ._pipeline.remainder import Remainder
from ._pipeline.reservations import ShardReservations, copy_bytes
from ._pipeline.run import EpochRun, RunState
from ._pipeline.shard import Owned, Prepare, Shard
from ._pipeline.sizes import ShardSizes, part_rows, stride_turn
from ._pipeline.tuning import DEFAULT_PREFETCH, Limits, Tunable, Tuner, start_knobs
from ._utils import validate as _validate
from ._utils.closing import Closing
from ._utils.columns import names_of, normalize_arrays
from ._utils.cores import usable_cores
from ._utils.distributed import resolve_parts
from ._utils.lifecycle import check_owner, track
from ._utils.random import key_hash, seeded_rng
from ._utils.retry import ErrorPolicy, OnError
from .errors import InvalidState, LoaderClosed, SchemaMismatch, add_note
from .records import ShardRecord
from .sources import RawShard, Source
from .stats import Stats

__all__ = ["EpochRun", "Prepare", "RunState", "Shard", "ShardStream"]

logger = logging.getLogger(__name__)

DEAL_MODES = ("shards", "samples", "strides", "turns", "balanced")

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
        prefetch: Shards produced ahead of the one being consumed (0: none). ``'auto'``
            (default): 2, or tuned within ``memory_budget``.
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
            ``'turns'``: the same strides, the first row turning to the next part from shard to
            shard and from pass to pass, so that shards smaller than the part count starve no
            part (``samples_per_epoch`` with fewer keys than ranks). ``'balanced'``: the same
            strides going on from where the last shard's stopped (row ``i`` of a shard with
            ``r`` rows before it in the epoch goes to part ``(r + i) % num_parts``), so the
            parts' counts never differ by more than one (``even_batches=True`` without sizes).
        generate_ahead: With a ``cache_dir``, producers that would otherwise sit idle generate
            up to this many shards beyond the ``prefetch`` window into the cache (disk, not
            memory), in key order: a shard that takes long to generate no longer holds up the
            ones after it, while batches keep their order and at most ``prefetch + 1`` shards
            are loaded. ``'auto'`` (default): ``2 * (prefetch + 1)`` with a cache, else 0, and
            with a ``cache_limit`` of N shards at most ``N - prefetch - 2`` (shards made ahead
            are not evicted before they are read).
        memory_budget: Bytes (or a string with a unit: ``"4GiB"``, ``"512MB"``) the stream may
            hold for data: shards produced or loading ahead, the copies producers make, and what
            a loader keeps in flight. Each shard's raw arrays, transform output and copy are
            admitted against it before they are allocated (:attr:`gate`, see
            :mod:`gluon_stream._pipeline.admission`). Within it ``prefetch`` and ``producers``
            (unless given) are tuned live from what is measured, each change logged at INFO
            with its reason and kept in :attr:`Stats.tuning`; a budget that cannot hold the
            least settings raises :class:`~gluon_stream.MemoryBudgetTooSmall` naming what it
            counts (see :mod:`gluon_stream._pipeline.tuning` and the memory-budget guide).
        context_rows: ``transform`` receives the last ``context_rows`` raw rows before the
            shard's key, in the source's key order (its key list for the epoch, before any
            shuffle or deal), followed by the shard's own rows (each raw array alike), so that
            windows span the keys' boundaries; rows come from as many previous keys as needed.
            The first key of the list gets none. A producer makes the previous keys' shards
            itself (a cache hit with a ``cache_dir``: give one, or they are made again). See
            :mod:`gluon_stream._pipeline.context` and the time-series guide.
        context_break: ``fn(previous_key, key) -> bool``: True where context must not flow
            (a gap in the dates, a new episode): the series starts afresh at ``key``.

    Example:
        >>> from gluon_stream import FunctionSource
        >>> with ShardStream(FunctionSource(range(3), lambda k: np.arange(4) + 10 * k)) as s:
        ...     [(shard.key, len(shard)) for shard in s]
        [(0, 4), (1, 4), (2, 4)]
    """

    def __init__(self, source: Source, *, transform: Callable[[Any], Any] | None = None,
                 prefetch: int | str = "auto", producers: int | str | cf.Executor = "auto",
                 shuffle: bool = False,
                 seed: int | None = None, on_error: OnError = "raise",
                 schema: Sequence[tuple[Any, Sequence[int]]] | None = None,
                 stats: Stats | None = None, num_parts: int | str = 1,
                 part_index: int | str = 0, kvstore: Any = None,
                 shard_sizes: Mapping[Any, int] | Callable[[Any], int] | int | None = None,
                 num_epochs: int | None = None, deal: str = "shards",
                 generate_ahead: int | str = "auto",
                 memory_budget: int | str | None = None, context_rows: int = 0,
                 context_break: ContextBreak | None = None) -> None:
        if not isinstance(source, Source):
            raise TypeError(f"source must be a CommandSource, FunctionSource or FileSource, got "
                            f"{type(source).__name__}")
        budget = (None if memory_budget is None
                  else _validate.byte_size("memory_budget", memory_budget))
        fixed_prefetch = not (isinstance(prefetch, str) and prefetch == "auto")
        self._remote = producers if isinstance(producers, cf.Executor) else None
        self.auto_producers = producers == "auto"
        caches = bool(getattr(source, "cached", False)) and self._remote is None
        start = None if budget is None else start_knobs(
            caches and source.generates_apart and self.auto_producers,
            usable_cores())
        prefetch = _validate.integer("prefetch", prefetch if fixed_prefetch else (
            DEFAULT_PREFETCH if start is None else start.prefetch), minimum=0)  # starts low
        if self._remote is not None:  # local threads only wait for, load and transform shards
            throttle = Throttle(prefetch + 1, prefetch + 1)
        elif self.auto_producers and start is not None:  # the tuner sets the count
            throttle = Throttle(start.producers, usable_cores())
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
        #: context_rows: the previous keys' last rows put before a shard's (None: no context)
        self.context = context_rows_of(context_rows, context_break, source, transform)
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
        # context_rows over keys(epoch): a key's context, so its size, may change per epoch
        self.sizes.per_epoch = self.context is not None and not source.same_keys
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
        #: memory admitted before it is allocated, within the budget (None: no budget)
        self.gate = None if budget is None else MemoryGate(budget)
        target: Tunable = self
        self.tuner = None if budget is None else Tuner(
            target, Limits(budget, throttle.bound, fixed_prefetch=fixed_prefetch,
                           fixed_producers=not self.auto_producers),
            lambda: self.stats.clock() - self.stats.origin, self.stats.add_tuning)
        if self.tuner is not None and self.gate is not None:
            self.tuner.on_rows = self.gate.set_outside
        self._finalizer = weakref.finalize(self, _close_all, self._res, self.gate)
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

    def idle_producers(self) -> int:
        """Producers free to start a shard now: those that may work at once less those at work
        (below 0 while the ``memory_budget`` tuner's lower count lets shards at work finish)."""
        throttle = self._res.throttle
        return throttle.active - throttle.running

    def waited(self, key: Any, queued: int = 0) -> None:
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

    def keys_between(self, epoch: int, start: int, stop: int) -> list:
        """This part's keys at positions ``start .. stop - 1`` of pass ``epoch`` (fewer where
        its keys end): a key list's, or an endless iterator's drawn again up to them, as a
        resumed pass draws them (a resumed state's mixed units name their shards so)."""
        remainder = self.remainder_of(epoch)
        if remainder is None or remainder.tail is None or stop <= len(remainder.pieces):
            return list(itertools.islice(self.epoch_keys(epoch, start=start)[0], stop - start))
        # an elastic resume's tail (the keys after its pieces): from the iterator built anew,
        # leaving the one the remainder's pass reads where it stands
        fresh = self.endless_keys(epoch)
        if fresh is remainder.tail.rest:
            raise InvalidState(
                f"field 'keys': the state holds samples of shard {stop - 1} of epoch {epoch}, a "
                "key of the endless iterator after an elastic resume's pieces, drawn again from "
                "its beginning to name it; an iterator given itself gives its keys once: give "
                "keys=fn(pass) that builds the iterator anew")
        pieces = len(remainder.pieces)
        tail = part_endless(itertools.islice(fresh, remainder.tail_start, None),
                            self.num_parts, self.part_index, self.deal)
        return remainder.keys[start:stop] + list(
            itertools.islice(tail, max(0, start - pieces), stop - pieces))

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

    def forget_failure(self, key: Any, epoch: int) -> None:
        """Forget a failure of shard ``key`` recorded in the cache, so that a retry makes it
        again (``on_error=('retry', n)``; see :meth:`CachingSource.retry_failures`)."""
        self.source.retry_failures([key], epoch)

    def row_order(self, key: Any, epoch: int, length: int, index: int = -1,
                  before: int | None = None) -> np.ndarray | None:
        """The rows of a shard this part reads, in order (None: all of them, as they are);
        ``index``: its position in the epoch (a remainder's piece says which rows are left);
        ``before``: ``deal='balanced'``, the rows of the epoch's shards before it."""
        remainder = self.remainder_of(epoch)
        if remainder is not None and remainder.is_piece(index):  # else: an endless tail's key
            made = remainder.pieces[index].epoch
            own = self.shard_order(key, made, length)
            agreed = self.sizes.rows_before(epoch, index)  # else: learned, as a fresh epoch's
            learned = before if self.sizes.learns_rows(epoch) else None
            return remainder.rows(index, np.arange(length) if own is None else own,
                                  self.num_parts, self.part_index, self.deal,
                                  agreed if agreed is not None else learned)
        order = self.shard_order(key, epoch, length)
        if self.deal != "shards" and self.num_parts > 1:
            rows = np.arange(length) if order is None else order
            # an endless remainder's tail (keys after its pieces): as its pieces (equal
            # strides where it was merged by an older gluon_stream)
            deal = "samples" if remainder is not None and self.deal == "balanced" \
                and not self.sizes.learns_rows(epoch) else self.deal
            order = part_rows(rows, self.num_parts, self.part_index, deal,
                              stride_turn(deal, epoch, index, before))
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
                    skipped: Sequence[int] = (), reuse: "EpochRun | None" = None,
                    rows_before: int = 0) -> "EpochRun":
        """Begin producing the current epoch after ``skip`` shards; cancels any unfinished pass.

        ``skipped``: positions of shards that failed before (``on_error='skip'``, recorded in a
        resumed state): they count as skipped again without being produced, so a resume sees
        the epoch the interrupted pass saw. ``reuse``: a pass of this epoch that stopped at
        ``skip`` (an epoch of ``samples_per_epoch`` ended there): it goes on, with the shards it
        produced ahead, instead of a new one. ``rows_before``: ``deal='balanced'``, the rows of
        the epoch's shards before position ``skip`` (a resume's state holds them).

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
        return self._new_run(epoch, skip, prepare, skipped, rows_before)

    def _new_run(self, epoch: int, skip: int, prepare: Prepare | None,
                 skipped: Sequence[int] = (), rows_before: int = 0) -> "EpochRun":
        run = EpochRun(self, epoch, skip, prepare, skipped, rows_before)
        self._res.runs.add(run)
        return run

    @property
    def next_run(self) -> EpochRun | None:
        """The pass of the next epoch, begun early while this one ends (None: none is)."""
        return self._next_run

    def run_ahead(self, epoch: int, prepare: Prepare | None) -> EpochRun:
        """The pass of the epoch after this one, started early to hide its first shards' cost."""
        ahead = self._next_run
        if ahead is None or ahead.epoch != epoch or ahead.prepare is not prepare:
            if ahead is not None:
                ahead.cancel()
            ahead = self._next_run = self._new_run(epoch, 0, prepare)
        return ahead

    def counted_size(self, key: Any, epoch: int) -> int:
        """A shard's samples after the transform: known ahead or seen (see
        :meth:`ShardSizes.full_size`), else counted by producing it whole in the calling thread
        (a cache hit with a ``cache_dir``), and remembered. An elastic resume of
        ``samples_per_epoch`` walks the ranks' streams by them. A shard that fails with
        ``on_error='skip'`` holds 0 (a pass reading it skips it)."""
        n = self.sizes.full_size(key, epoch)
        if n is not None:
            return n
        try:
            n = self.produce_now(key, epoch, whole=True).full_size
        except (LoaderClosed, InvalidState):
            raise
        except Exception as exc:  # as a pass would: skipped, or raised
            if self.on_error != "skip":
                raise
            logger.warning("shard %r of epoch %d failed while its samples were counted "
                           "(%s: %s): it counts as 0 samples, as a pass skips it", key, epoch,
                           type(exc).__name__, exc)
            return 0
        self.sizes.remember(key, epoch, n)
        return n

    def produce_now(self, key: Any, epoch: int, prepare: Prepare | None = None,
                    index: int = -1, whole: bool = False, before: int | None = None) -> Shard:
        """Produce one shard in the calling thread, exactly as the producers would (for resume;
        ``index``: its position in the epoch, where a remainder's piece is read; ``whole``:
        every row, in the file's order, not this part's rows in its order; ``before``:
        ``deal='balanced'``, the rows of the epoch's shards before it)."""
        self.check_open()
        return self._make(key, epoch, index, None, prepare, whole, before)

    def submit_shard(self, key: Any, epoch: int, index: int, run: EpochRun,
                     prepare: Prepare | None) -> cf.Future:
        """Produce shard ``key`` at position ``index`` of ``epoch`` for ``run`` in a producer
        thread: a future of the :class:`Shard`. With a ``memory_budget`` its admission opens
        here, in the order the loop needs the shards (a producer that starts a later shard
        first leaves room for the earlier ones)."""
        adm = self._open_admission(key, epoch, index)
        fut = self._res.executor.submit(self._produce, key, epoch, index, run, prepare, adm)
        if adm is not None:  # never run, or failed: nothing is held
            fut.add_done_callback(lambda f: adm.release() if f.cancelled() or f.exception()
                                  is not None else None)
        return fut

    def _open_admission(self, key: Any, epoch: int, index: int) -> Admission | None:
        if self.gate is None:
            return None
        return self.gate.open((epoch, index), f"shard {key!r} (epoch {epoch})",
                              self.transform is not None)

    def submit_generation(self, key: Any, epoch: int, index: int, run: EpochRun) -> cf.Future:
        """Generate shard ``key`` of ``epoch`` (at position ``index`` of ``run``'s pass) into
        the cache for ``run`` in a producer thread (it waits there for its turn in the window):
        a future of the seconds it took."""
        return self._res.executor.submit(self._generate, key, epoch, index, run)

    def _produce(self, key: Any, epoch: int, index: int, run: "EpochRun | None",
                 prepare: Prepare | None, adm: Admission | None = None) -> Shard:
        """Runs in a producer thread: generate/load, transform, shuffle, prepare. A failure
        gives its admission back here: the submitter may never have had the future (a Ctrl-C
        in ``submit``), so its done-callback may not be there to do it."""
        try:
            if run is not None and run.cancelled:
                raise LoaderClosed("epoch pass cancelled")
            if run is None:  # produce_now: in the caller's thread, outside the producers' count
                return self._make(key, epoch, index, run, prepare, adm=adm)
            try:  # made ahead into the cache: only loading is left once its generation is done
                with self._placed(run, index) as generated_s:
                    shard = self._make(key, epoch, index, run, prepare, adm=adm)
            except BaseException:
                if run.offsets is not None:  # the shards after it stop waiting for its size
                    run.offsets.failed(index)
                raise
        except BaseException:
            if adm is not None:
                adm.release()  # idempotent
            raise
        if generated_s and shard.record is not None:
            shard.record.generate_s += generated_s
            shard.record.cache_hit = False
        return shard

    def _generate(self, key: Any, epoch: int, index: int, run: "EpochRun") -> float:
        """Runs in a producer thread: make a shard in the cache without loading it (it waits
        there, on disk, for its turn in the ``prefetch`` window); the seconds it took, or 0
        when it was cached already."""
        with self._placed(run, index, ahead=True):
            if run.cancelled:
                raise LoaderClosed("epoch pass cancelled")
            lane = self._res.throttle.lane()
            t0 = self.stats.clock()
            _, hit, seconds = self.source.ensure_file(key, epoch)
            if hit:
                return 0.0
            self.stats.add_span(lane, "generate", t0, t0 + seconds, key)
            return seconds

    @contextlib.contextmanager
    def _placed(self, run: EpochRun, index: int, ahead: bool = False) -> Iterator[float]:
        """A producer's place for ``run``'s work on shard ``index``, held for the block: a
        generation ahead (``ahead``), or a shard of the window, which first waits for its
        generation ahead if one runs (the block gets its seconds). Places go in the order the
        loop needs the shards (the pass's epoch, then ``index``: see :class:`Throttle`), and
        until the place is taken the run counts the work as queued (from the end of that
        generation), so no new generation ahead starts while the window's shard waits."""
        if ahead:
            run.unplaced(1)
        got = 0.0
        try:
            if not ahead:
                got = run.generated(index)  # counts the work as queued once it returns
            self._res.throttle.take((run.epoch, index))
        finally:
            run.unplaced(-1)
        try:
            yield got
        finally:
            self._res.throttle.give()

    def _make(self, key: Any, epoch: int, index: int, run: "EpochRun | None",
              prepare: Prepare | None, whole: bool = False, before: int | None = None,
              adm: Admission | None = None) -> Shard:
        """Make one shard, its memory admitted against ``memory_budget`` part by part before
        it is allocated (:mod:`gluon_stream._pipeline.admission`; ``adm``: opened when the
        shard was submitted): the admission is held until the shard is freed."""
        if adm is None:
            adm = self._open_admission(key, epoch, index)
        try:
            if run is not None and run.cancelled:
                raise LoaderClosed("epoch pass cancelled")
            # a producer's place is held only in a pass (produce_now runs in the caller's thread)
            gate = ShardReservations(
                adm, lambda: self.closed or (run is not None and run.cancelled),
                self._res.throttle.released if run is not None else None)
            shard = self._admitted(key, epoch, index, run, prepare, whole, before, gate)
        except Deferred as exc:
            if adm is not None:
                adm.release()
            # without the frames that made the shard (nor those of the exception it came from):
            # the future keeps the exception until the loop reaches the shard, and they would
            # keep its arrays alive
            exc.__context__ = exc.__cause__ = None
            raise exc.with_traceback(None) from None
        except BaseException:
            if adm is not None:
                adm.release()
            raise
        if adm is not None:
            shard.admission = adm
            # given back when the memory is: the prepared arrays' owner (shared memory lives
            # while workers hold it), else the shard
            weakref.finalize(getattr(shard.arrays, "memory_owner", shard), adm.release)
        return shard

    def _admitted(self, key: Any, epoch: int, index: int, run: "EpochRun | None",
                  prepare: Prepare | None, whole: bool, before: int | None,
                  gate: ShardReservations) -> Shard:
        lane = self._res.throttle.lane()
        clock = self.stats.clock
        t0 = clock()
        made = self.made_epoch(epoch, index)
        # exact from a file's headers where the source can tell (a program's shard, made
        # first), else the largest raw shard seen
        peek = self.source.raw_bytes(key, made) \
            if gate.adm is not None and self._remote is None else None
        gate.reserve("raw", None if peek is None else peek[0])
        raw: RawShard = (self.source.produce(key, made) if self._remote is None
                         else self.source.produce(key, made, executor=self._remote))
        if peek is not None:  # it was made (or found) by the peek
            raw.cache_hit, raw.generate_s = peek[1], raw.generate_s + peek[2]
        gate.made("raw", raw.arrays)
        if self.context is not None:  # the previous keys' last raw rows, before this shard's
            self.context.extend(raw, made, self._produce_raw, gate,
                                lambda: self.closed or (run is not None and run.cancelled))
        t1 = clock()
        arrays = raw.arrays
        owned = raw.owned and self.transform is None  # a transform's output is user code's
        if self.transform is not None:
            gate.reserve("transformed")  # the largest seen (the raw shard's size at first)
            arg = arrays[0] if len(arrays) == 1 else arrays
            try:
                value = self.transform(arg)
            except Exception as exc:
                add_note(exc, f"gluon_stream: raised by transform on shard {key!r} "
                              f"(file {raw.path!r}, epoch {epoch})")
                raise
            arrays = normalize_arrays(value, what=f"transform output of shard {key!r}")
            del arg, value  # the transform's output is held by ``arrays`` alone
            gate.made("transformed", arrays)
        full_size = len(arrays[0])
        nbytes = sum(int(getattr(a, "nbytes", 0)) for a in arrays)
        if run is not None and run.offsets is not None:  # deal='balanced'
            before = self._rows_before(run, index, full_size)
        order = None if whole else self.row_order(key, epoch, full_size, index, before)
        if run is not None and run.cancelled:
            raise LoaderClosed("epoch pass cancelled")
        names = names_of(arrays)
        source_nbytes = gate.source_bytes()
        copies = prepare is not None or order is not None
        if copies:  # its exact bytes, before the copy is made
            gate.reserve("copy", copy_bytes(arrays, order))
        if prepare is not None:  # it applies the order while copying (no extra copy)
            what = f"shard {key!r} (file {raw.path!r}, epoch {epoch})"
            # the raw shard's let go; arrays the loader owns are handed over as Owned: their
            # copy may give their memory back (see gluon_stream._mx.consumed)
            arrays, raw.arrays = (Owned if owned else tuple)(list(arrays)), ()
            arrays = prepare(arrays, order, what)
        elif order is not None:
            arrays = tuple(a[order] for a in arrays)  # not np.take: it copies a strided input
        # a form that keeps the source arrays (``raw``: a shuffle window's shards) copied none
        gate.copied(copies and getattr(arrays, "raw", None) is None)
        shard = Shard(key, epoch, index, arrays, names=names, full_size=full_size,
                      rows=int(arrays[0].shape[0]), schema=schema_of(arrays),
                      source_nbytes=source_nbytes)
        t2 = clock()
        gen_end = t0 + raw.generate_s
        load_end = gen_end + raw.load_s
        self.stats.add_span(lane, "generate", t0, gen_end, key)
        self.stats.add_span(lane, "load", gen_end, load_end, key)
        self.stats.add_span(lane, "transform", max(load_end, t1), t2, key)
        shard.record = ShardRecord(key, epoch, len(shard), raw.cache_hit, raw.generate_s,
                                   raw.load_s, t2 - t1, lane, source=raw.source, nbytes=nbytes)
        return shard

    def _produce_raw(self, key: Any, epoch: int) -> RawShard:
        """A shard's raw arrays, made as a producer makes them (the context of another)."""
        if self._remote is None:
            return self.source.produce(key, epoch)
        return self.source.produce(key, epoch, executor=self._remote)

    def _rows_before(self, run: "EpochRun", index: int, full_size: int) -> int:
        """``deal='balanced'``: tell the run this shard's size and wait for the rows before
        it, letting another producer work meanwhile (the shard it waits for may need one)."""
        assert run.offsets is not None
        rows = self.sizes.rows_dealt(run.epoch, index, full_size)  # a remainder's: rows left
        with self._res.throttle.released():
            return run.offsets.before(index, rows, lambda: run.cancelled or self.closed)

    def check_schema(self, shard: Shard) -> None:
        """Raise :class:`~gluon_stream.SchemaMismatch` unless ``shard``'s arrays batch with the
        first shard's (or ``schema=``)."""
        found = shard.schema if shard.schema is not None else schema_of(shard.arrays)
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


def _close_all(res: ProducerPool, gate: MemoryGate | None) -> None:
    if gate is not None:  # producers waiting for memory wake and stop
        gate.close()
    res.close()
