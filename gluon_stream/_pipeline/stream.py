"""ShardStream: shards in order, produced ahead of the consumer by a bounded thread pool.

Producer threads generate, load, transform and (when shuffling) permute each shard
while the consumer works on the current one; at most ``prefetch`` shards are ever
ahead of it, so at most ``prefetch + 1`` shards are held at once. Threads, not
processes: generation runs in external processes or in numpy code that releases the
GIL, and nothing has to be forked or pickled.

The contract with a consumer such as :class:`~gluon_stream.StreamLoader` is public:
:meth:`ShardStream.start_epoch` begins a pass (optionally with a ``prepare`` step that runs in
the producer threads, e.g. copying the shard into an NDArray) and returns an
:class:`KeyPass`, whose :meth:`~KeyPass.next_shard` hands out the shards in order. The pass
lives in :mod:`gluon_stream._pipeline.run` and drives the stream through the public methods
of its :class:`~gluon_stream._pipeline.run.ShardMaker` contract. The stream wires the keys
stage (:mod:`.deal`) and the production stage (:mod:`.produce`); the public
:mod:`gluon_stream.stream` names it, ``Shard``, ``KeyPass``, ``RunState`` and ``Prepare``.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import weakref
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from .._utils import validate as _validate
from .._utils.closing import Closing
from .._utils.distributed import resolve_parts
from .._utils.lifecycle import check_owner, track
from .._utils.retry import ErrorPolicy, OnError
from ..errors import LoaderClosed
from ..sources import Source
from ..stats import Stats
from .admission import MemoryGate
from .context import ContextBreak, ContextRows, context_rows_of
from .deal import KeyDealer
from .produce import Producer
from .producers import ProducerPool, first_knobs
from .remainder import Remainder
from .run import KeyPass
from .shard import Prepare, Shard
from .sizes import ShardSizes
from .tuning import Limits, Tuner

__all__ = ["ShardStream"]

# the public name: its lines are filtered by it (docs/memory-budget.md)
logger = logging.getLogger("gluon_stream.stream")

DEAL_MODES = ("shards", "samples", "strides", "turns", "balanced")

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
        deal: How ``num_parts`` split an epoch: ``'shards'`` (default, each part its share of
            the shards), or every part reads every shard and takes its stride of each one's
            samples: ``'samples'`` (equal counts, fewer than ``num_parts`` samples dropped per
            shard), ``'strides'`` (nothing dropped), ``'turns'`` (the first row turns from shard
            to shard and pass to pass) or ``'balanced'`` (strides go on across shards: counts
            never differ by more than one). See the multi-host guide.
        generate_ahead: With a ``cache_dir``, producers that would otherwise sit idle generate
            up to this many shards beyond the ``prefetch`` window into the cache (disk, not
            memory), in key order: a shard that takes long to generate no longer holds up the
            ones after it, while batches keep their order and at most ``prefetch + 1`` shards
            are loaded. ``'auto'`` (default): ``2 * (prefetch + 1)`` with a cache, else 0, and
            with a ``cache_limit`` of N shards at most ``N - prefetch - 2`` (shards made ahead
            are not evicted before they are read).
        memory_budget: Bytes (or ``"4GiB"``, ``"512MB"``) the stream may hold for data:
            each shard's raw arrays, transform output and copy are admitted against it before
            they are allocated (:attr:`gate`), and ``prefetch`` and ``producers`` (unless
            given) are tuned live within it, each change logged at INFO and kept in
            :attr:`Stats.tuning`; too small a budget raises
            :class:`~gluon_stream.MemoryBudgetTooSmall` (see the memory-budget guide).
        context_rows, context_break: The last ``context_rows`` raw rows of the keys before a
            shard's, in key order, put before its own for ``transform`` (see
            :class:`~gluon_stream.StreamLoader` and the time-series guide).

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
        prefetch, throttle = first_knobs(
            prefetch, producers, budget,
            caches and source.generates_apart and self.auto_producers)
        _validate.callable_or_none("transform", transform)
        self.source = source
        self.transform = transform
        # context_rows: nothing of it runs unless asked for
        context = context_rows_of(context_rows, context_break, source, transform) \
            if context_rows != 0 or context_break is not None else None
        self.prefetch = prefetch
        self.shuffle = bool(shuffle)
        self.num_parts, self.part_index = resolve_parts(num_parts, part_index, kvstore=kvstore)
        self.deal = _validate.choice("deal", deal, DEAL_MODES)
        self.seed_given = seed is not None
        #: the keys stage: which keys and rows this part reads
        self.dealer = KeyDealer(source, _seed(seed, self.shuffle, self.num_parts), self.shuffle,
                                self.num_parts, self.part_index, self.deal)
        self.error_policy = ErrorPolicy.parse(on_error)
        self.stats = stats if stats is not None else Stats()
        self.epoch = 0
        self._next_run: KeyPass | None = None
        #: what is known of the shards' sizes without producing them (len, even_batches)
        self.sizes = ShardSizes(source, transform, shard_sizes, self.deal, self.num_parts,
                                self.part_index, self.dealer.epoch_keys, self.dealer.remainder_of)
        self.dealer.sizes = self.sizes
        # context_rows over keys(epoch): a key's context, so its size, may change per epoch
        self.sizes.per_epoch = context is not None and not source.same_keys
        self._generate_auto = generate_ahead == "auto" and caches
        self.generate_ahead = (_auto_generate_ahead(source, prefetch) if self._generate_auto
                               else _fixed_generate_ahead(generate_ahead, caches))
        self.num_epochs = (None if num_epochs is None
                           else _validate.integer("num_epochs", num_epochs, minimum=1))
        self._pool = ProducerPool(source, throttle)
        self._production(budget, fixed_prefetch, schema, context)

    def _production(self, budget: int | None, fixed_prefetch: bool, schema: Any,
                    context: ContextRows | None) -> None:
        """The memory gate and the tuner (with a ``memory_budget``), the production stage, and
        what closes them."""
        self.memory_budget = budget
        #: memory admitted before it is allocated, within the budget (None: no budget)
        self.gate = None if budget is None else MemoryGate(budget)
        self.tuner: Tuner | None = None
        if self.gate is not None:
            limits = Limits(self.gate.budget, self._pool.throttle.bound,
                            fixed_prefetch=fixed_prefetch, fixed_producers=not self.auto_producers)
            self.tuner = Tuner(self, limits, lambda: self.stats.clock() - self.stats.origin,
                               self.stats.add_tuning)
            self.tuner.on_rows = self.gate.set_outside  # rows a loader holds, admitted too
        #: the production stage: shards made in the producer threads or the caller's
        self.producer = Producer(self.source, self.transform, self._pool, self.gate,
                                 self.dealer, self.sizes, self.stats, self.error_policy, schema,
                                 self._remote, self.check_open, self.tuner, context)
        self._finalizer = weakref.finalize(self, _close_all, self._pool, self.gate)
        track(self, self._finalizer)

    # -- configuration ------------------------------------------------------------------
    @property
    def producers(self) -> int:
        """Shards produced at once now (with ``'auto'``, it grows up to its bound)."""
        return self._pool.throttle.active

    def set_prefetch(self, prefetch: int) -> None:
        """Produce ``prefetch`` shards ahead from the next shard on (the ``memory_budget``
        tuner; shards already ahead beyond it are handed out as usual). ``generate_ahead='auto'``
        follows it."""
        self.prefetch = _validate.integer("prefetch", prefetch, minimum=0)
        if self._generate_auto:
            self.generate_ahead = _auto_generate_ahead(self.source, self.prefetch)

    def set_producers(self, producers: int) -> None:
        """Produce ``producers`` shards at once (the ``memory_budget`` tuner), within the
        producer threads the stream has."""
        self._pool.throttle.set_active(_validate.integer("producers", producers, minimum=1))

    def idle_producers(self) -> int:
        """Producers free to start a shard now: those that may work at once less those at work
        (below 0 while the ``memory_budget`` tuner's lower count lets shards at work finish)."""
        throttle = self._pool.throttle
        return throttle.active - throttle.running

    def waited(self, key: Any, queued: int = 0) -> None:
        """The consumer had to wait for shard ``key``: with ``'auto'``, add a producer if every
        producer is busy (running, or about to run one of the ``queued`` shards) and a core
        is free (the loop, waiting, uses none). With a ``memory_budget`` the tuner decides,
        from this and the budget."""
        throttle = self._pool.throttle
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
        return self._pool.closed.is_set()

    def check_open(self) -> None:
        check_owner(self, "ShardStream")
        if self.closed:
            raise LoaderClosed("this ShardStream/StreamLoader is closed; create a new one")

    def adopt_seed(self, seed: int) -> None:
        """Take ``seed`` (a resumed state's) in place of the one drawn for ``seed=None``."""
        if self.seed_given:
            raise ValueError(f"this stream was given seed={self.seed}; it keeps it")
        self.dealer.seed = _validate.integer("seed", seed)
        self._drop_runs()

    @property
    def seed(self) -> int:
        """The seed of the shuffle and of per-sample randomness (the dealer's)."""
        return self.dealer.seed

    def set_remainder(self, remainder: Remainder | None) -> None:
        """Read ``remainder`` in place of its epoch's keys (an elastic resume; None: the keys)."""
        if remainder is not self.dealer.remainder:
            self.dealer.remainder = remainder
            self._drop_runs()

    def _drop_runs(self) -> None:
        self._next_run = None
        for run in list(self._pool.runs):  # shards made ahead in another order
            run.cancel()

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
                    skipped: Sequence[int] = (), reuse: "KeyPass | None" = None,
                    rows_before: int = 0) -> "KeyPass":
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
            for old in list(self._pool.runs):
                if old is not reuse and old is not self._next_run:
                    old.cancel()
            return reuse
        ahead, self._next_run = self._next_run, None
        for old in list(self._pool.runs):
            if old is not ahead:
                old.cancel()
        if (ahead is not None and ahead.epoch == epoch and not skip and not skipped
                and not ahead.cancelled and ahead.prepare is prepare):
            return ahead  # its first shards were produced while the last epoch ended
        if ahead is not None:
            ahead.cancel()
        return self._new_run(epoch, skip, prepare, skipped, rows_before)

    def _new_run(self, epoch: int, skip: int, prepare: Prepare | None,
                 skipped: Sequence[int] = (), rows_before: int = 0) -> "KeyPass":
        run = KeyPass(self, epoch, skip, prepare, skipped, rows_before)
        self._pool.runs.add(run)
        return run

    @property
    def next_run(self) -> KeyPass | None:
        """The pass of the next epoch, begun early while this one ends (None: none is)."""
        return self._next_run

    def run_ahead(self, epoch: int, prepare: Prepare | None) -> KeyPass:
        """The pass of the epoch after this one, started early to hide its first shards' cost."""
        ahead = self._next_run
        if ahead is None or ahead.epoch != epoch or ahead.prepare is not prepare:
            if ahead is not None:
                ahead.cancel()
            ahead = self._next_run = self._new_run(epoch, 0, prepare)
        return ahead

    # -- lifecycle ------------------------------------------------------------------------
    def close(self) -> None:
        """Stop producers, kill running generators and release everything; idempotent."""
        self._finalizer()


def _auto_generate_ahead(source: Source, prefetch: int) -> int:
    """``generate_ahead='auto'`` for ``prefetch``: two windows' worth, within the
    ``cache_limit``."""
    ahead = 2 * (prefetch + 1)
    room = source.cache_room
    if room is not None:  # shards made ahead must not be evicted before they are read
        ahead = max(0, min(ahead, room - prefetch - 2))
    return ahead


def _fixed_generate_ahead(generate_ahead: int | str, caches: bool) -> int:
    """``generate_ahead`` given as a number (``'auto'`` without a cache: 0)."""
    if generate_ahead == "auto":
        return 0
    ahead = _validate.integer("generate_ahead", generate_ahead, minimum=0, hint="or 'auto'")
    if ahead and not caches:
        raise ValueError(f"generate_ahead={generate_ahead} generates shards into a cache while "
                         "they wait to be loaded: it needs a source with a cache_dir, and local "
                         "producers")
    return ahead


def _seed(seed: int | None, shuffle: bool, parts: int) -> int:
    """The stream's seed: the one given, else drawn (one part) or 0 (several parts, which
    deal shards alike without shuffling)."""
    if seed is None and shuffle and parts > 1:
        raise ValueError("shuffle=True with num_parts > 1 needs an explicit seed, the same on "
                         "every rank, so that the ranks agree on who gets which shard")
    if seed is None and parts == 1:
        seed = int(np.random.SeedSequence().generate_state(1)[0]) % (2 ** 31)
        (logger.info if shuffle else logger.debug)(
            "no seed given: using seed=%d (shuffle order and per-sample randomness)", seed)
    return 0 if seed is None else _validate.integer("seed", seed)


def _close_all(res: ProducerPool, gate: MemoryGate | None) -> None:
    if gate is not None:  # producers waiting for memory wake and stop
        gate.close()
    res.close()
