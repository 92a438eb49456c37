"""The production stage: one shard made (generated, loaded, transformed, put in its rows'
order and the consumer's form), in a producer thread or the caller's, its memory admitted
against ``memory_budget`` part by part before it is allocated.

A :class:`Producer` owns nothing of a pass: the :class:`~gluon_stream._pipeline.run.KeyPass`
that submits a shard owns its future; the stream owns the producer pool and the gate.
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import numpy as np

from .._utils.retry import ErrorPolicy
from ..errors import LoaderClosed, SchemaMismatch
from ..records import ShardRecord
from .admission import Admission, MemoryGate
from .build import PassOf, ShardBuilder, schema_of
from .offsets import Deferred
from .producers import ProducerPool
from .reservations import ShardReservations
from .shard import Prepare, Shard

if TYPE_CHECKING:
    from ..sources import Source
    from ..stats import Stats
    from .context import ContextRows
    from .deal import KeyDealer
    from .sizes import ShardSizes
    from .tuning import Tuner

__all__ = ["PassOf", "Producer", "schema_of"]

# the stream's logger: its per-shard lines are filtered by this name (docs/memory-budget.md)
logger = logging.getLogger("gluon_stream.stream")


class Producer:
    """Makes a stream's shards: submitted to its producer pool for a pass, or in the caller's
    thread (a resume, a size counted by producing the shard).

    Args:
        source: Where the raw shards come from.
        transform: ``transform(raw) -> arrays`` per shard, or None.
        pool: The stream's producer threads and their throttle.
        gate: The ``memory_budget`` admission gate, or None.
        dealer: The keys stage (each shard's rows, the epoch it was made for).
        sizes: What is known of shard sizes (remembered when counted).
        stats: Where spans and shard records go.
        error_policy: What a failing shard does.
        schema: The expected ``[(dtype, trailing shape)]`` (None: the first shard's).
        remote: An executor that generates shards elsewhere, or None.
        check_open: Raises unless the stream is open and used by its owner process.
        tuner: The ``memory_budget`` tuner, told of every shard handed out, or None.
        context: ``context_rows``: what puts the previous keys' rows before a shard's, or None.
    """

    def __init__(self, source: Source, transform: Callable[[Any], Any] | None,
                 pool: ProducerPool, gate: MemoryGate | None, dealer: KeyDealer,
                 sizes: ShardSizes, stats: Stats, error_policy: ErrorPolicy,
                 schema: Sequence[tuple[Any, Sequence[int]]] | None, remote: cf.Executor | None,
                 check_open: Callable[[], None], tuner: Tuner | None = None,
                 context: ContextRows | None = None) -> None:
        self.source, self.transform = source, transform
        self._pool, self.gate, self.dealer, self.sizes = pool, gate, dealer, sizes
        self.stats, self.error_policy = stats, error_policy
        self._schema = ([(np.dtype(d).str, tuple(s)) for d, s in schema]
                        if schema is not None else None)
        self._remote = remote
        #: the stream's check (closed, or used from another process than its owner's)
        self.check_open = check_open
        self.tuner = tuner
        #: what builds one shard's arrays (raw, context, transform, the part's rows, the form)
        self.builder = ShardBuilder(source, transform, pool, dealer, sizes, stats, remote,
                                    context)

    @property
    def context(self) -> ContextRows | None:
        """context_rows: the previous keys' last rows put before a shard's (None: none)."""
        return self.builder.context

    @property
    def keep_origins(self) -> bool:
        """provenance=True: each shard keeps its :class:`ShardOrigin` (set by the loader)."""
        return self.builder.keep_origins

    @keep_origins.setter
    def keep_origins(self, keep: bool) -> None:
        self.builder.keep_origins = keep

    @property
    def closed(self) -> bool:
        return self._pool.closed.is_set()

    def forget_failure(self, key: Any, epoch: int) -> None:
        """Forget a failure of shard ``key`` recorded in the cache, so that a retry makes it
        again (``on_error=('retry', n)``; see :meth:`CachingSource.retry_failures`)."""
        self.source.retry_failures([key], epoch)

    def handed(self, shard: Shard, index: int, wait_s: float, before: int | None) -> None:
        """A good shard at position ``index`` of its pass is handed to the consumer (which
        waited ``wait_s`` for it): recorded, told to the tuner (which may refuse it, before
        any batch of it), its size remembered and checked against a declared one
        (``before``: ``deal='balanced'``, the rows before it)."""
        record, key, epoch = shard.record, shard.key, shard.epoch
        assert record is not None  # _make records every shard it makes
        self.stats.add_shard(record)
        if shard.admission is not None:  # the loop has it: shards after it rank first
            shard.admission.handed()
        if self.tuner is not None:
            self.tuner.shard_ready(key, record.nbytes, record.samples, wait_s,
                                   record.generate_s + record.load_s + record.transform_s,
                                   epoch, shard.source_nbytes)
        self.sizes.remember(key, self.dealer.made_epoch(epoch, index), shard.full_size)
        if self.dealer.remainder_of(epoch) is None:
            self.sizes.check_declared(key, epoch, index, before, len(shard))
        logger.info("shard %r ready: %d samples (generate %.2f s, load %.2f s, "
                    "transform %.2f s%s)", key, len(shard), record.generate_s,
                    record.load_s, record.transform_s, ", cached" if record.cache_hit else "")

    def failed(self, exc: BaseException, key: Any, epoch: int, index: int,
               retried: int) -> str:
        """Shard ``key`` at position ``index`` of pass ``epoch`` failed with ``exc`` after
        ``retried`` retries: ``'retry'`` (its cached failure forgotten) or ``'skip'`` (recorded
        in the stats), by the error policy (:meth:`ErrorPolicy.verdict`); else ``exc`` is
        raised. Logged at WARNING, in full at DEBUG."""
        verdict = self.error_policy.verdict(exc, retried)
        if verdict == "raise":
            raise exc
        summary = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        logger.debug("shard %r failure in full: %s", key, exc)
        if verdict == "retry":
            logger.warning("shard %r failed (%s); retry %d/%d", key, summary, retried + 1,
                           self.error_policy.retries)
            self.forget_failure(key, self.dealer.made_epoch(epoch, index))
        else:
            logger.warning("skipping shard %r (epoch %d): %s", key, epoch, summary)
            self.stats.add_shard(ShardRecord(key, epoch, error=f"{type(exc).__name__}: {exc}"))
        return verdict

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
        except Exception as exc:  # as a pass would: skipped, or raised (no retry here)
            if self.error_policy.verdict(exc, self.error_policy.retries) != "skip":
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

    def submit_shard(self, key: Any, epoch: int, index: int, run: PassOf,
                     prepare: Prepare | None) -> cf.Future:
        """Produce shard ``key`` at position ``index`` of ``epoch`` for ``run`` in a producer
        thread: a future of the :class:`Shard`. With a ``memory_budget`` its admission opens
        here, in the order the loop needs the shards (a producer that starts a later shard
        first leaves room for the earlier ones)."""
        adm = self._open_admission(key, epoch, index)
        fut = self._pool.executor.submit(self._produce, key, epoch, index, run, prepare, adm)
        if adm is not None:  # never run, or failed: nothing is held
            fut.add_done_callback(lambda f: adm.release() if f.cancelled() or f.exception()
                                  is not None else None)
        return fut

    def _open_admission(self, key: Any, epoch: int, index: int) -> Admission | None:
        if self.gate is None:
            return None
        return self.gate.open((epoch, index), f"shard {key!r} (epoch {epoch})",
                              self.transform is not None)

    def submit_generation(self, key: Any, epoch: int, index: int, run: PassOf) -> cf.Future:
        """Generate shard ``key`` of ``epoch`` (at position ``index`` of ``run``'s pass) into
        the cache for ``run`` in a producer thread (it waits there for its turn in the window):
        a future of the seconds it took."""
        return self._pool.executor.submit(self._generate, key, epoch, index, run)

    def _produce(self, key: Any, epoch: int, index: int, run: PassOf | None,
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

    def _generate(self, key: Any, epoch: int, index: int, run: PassOf) -> float:
        """Runs in a producer thread: make a shard in the cache without loading it (it waits
        there, on disk, for its turn in the ``prefetch`` window); the seconds it took, or 0
        when it was cached already."""
        with self._placed(run, index, ahead=True):
            if run.cancelled:
                raise LoaderClosed("epoch pass cancelled")
            lane = self._pool.throttle.lane()
            t0 = self.stats.clock()
            _, hit, seconds = self.source.ensure_file(key, epoch)
            if hit:
                return 0.0
            self.stats.add_span(lane, "generate", t0, t0 + seconds, key)
            return seconds

    @contextlib.contextmanager
    def _placed(self, run: PassOf, index: int, ahead: bool = False) -> Iterator[float]:
        """A producer's place for ``run``'s work on shard ``index``, held for the block: a
        generation ahead (``ahead``), or a shard of the window, which first waits for its
        generation ahead if one runs (the block gets its seconds). Places go in the order the
        loop needs the shards (the pass's epoch, then ``index``: see :class:`Throttle`), and
        until the place is taken the run counts the work as queued (from the end of that
        generation), so no new generation ahead starts while the window's shard waits."""
        if ahead:
            run.ahead.unplaced(1)
        got = 0.0
        try:
            if not ahead:
                got = run.ahead.wait_for(index)  # counts the work as queued once it returns
            self._pool.throttle.take((run.epoch, index))
        finally:
            run.ahead.unplaced(-1)
        try:
            yield got
        finally:
            self._pool.throttle.give()

    def _make(self, key: Any, epoch: int, index: int, run: PassOf | None,
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
                self._pool.throttle.released if run is not None else None)
            shard = self.builder.build(key, epoch, index, run, prepare, whole, before, gate)
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
