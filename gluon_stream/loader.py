"""StreamLoader: batches over a stream of shards, nothing lost or duplicated at shard boundaries.

Two ways to turn a shard into batches, chosen automatically:

* **vectorised** (no ``batchify_fn``, no ``sample_transform``): the producer thread copies
  the (already shuffled) shard into one NDArray in the background; batches are contiguous
  slices of it. No per-sample Python work, no worker pool, rotation costs microseconds,
  and the batches are exactly those a ``gluon.data.DataLoader`` would build.
* **DataLoader** (a ``batchify_fn`` or ``sample_transform`` is given): a
  ``gluon.data.DataLoader`` with the user's ``num_workers``/``thread_pool``/``pin_memory``
  iterates each shard. With threads or no workers one DataLoader serves every shard (the
  dataset it reads is swapped at each boundary); a process pool (``thread_pool=False``)
  must be forked per shard and is ended explicitly when the shard is done.

Either way, the samples left over at the end of a shard (fewer than ``batch_size``) start
the next shard's first batch, so every batch of an epoch is full except possibly the last,
which ``last_batch`` decides: ``'keep'``, ``'discard'`` or ``'rollover'`` (carried into the
next epoch, Gluon's meaning).
"""
from __future__ import annotations

import collections
import contextlib
import logging
import multiprocessing
import signal
import time
import weakref
from concurrent.futures import Executor
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from . import _compat
from ._closing import Closing
from .errors import BatchTimeout, LoaderClosed, WorkerDied
from .sources import Source
from .stats import EpochRecord, ProgressBar, Stats
from .stream import Shard, ShardStream, _EpochRun

__all__ = ["StreamLoader"]

logger = logging.getLogger(__name__)

LAST_BATCH_MODES = ("keep", "discard", "rollover")


class _ShardDataset:
    """Samples carried over from earlier shards, then a shard's rows from ``start`` on."""

    def __init__(self, carry: list, arrays: Sequence[Any],
                 sample_transform: Callable[..., Any] | None, start: int = 0) -> None:
        self.carry = carry
        self.arrays = tuple(arrays)
        self.sample_transform = sample_transform
        self.start = start

    def __len__(self) -> int:
        rows = len(self.arrays[0]) - self.start if self.arrays else 0
        return len(self.carry) + rows

    def __getitem__(self, idx: int) -> Any:
        if idx < len(self.carry):
            item = self.carry[idx]
        else:
            item = tuple(a[self.start + idx - len(self.carry)] for a in self.arrays)
        if self.sample_transform is not None:
            return self.sample_transform(*item)
        return item[0] if len(item) == 1 else item


class _Carry:
    """Samples waiting for the next batch, and the shard rows they came from (for state_dict).

    Chunks are tuples of NDArrays (vectorised path) or lists of samples (DataLoader path).
    """

    def __init__(self) -> None:
        self.chunks: list = []
        self.segments: list[dict] = []
        self.count = 0

    def add(self, chunk: Any, segment: dict, count: int) -> None:
        self.chunks.append(chunk)
        self.segments.append(segment)
        self.count += count

    def __len__(self) -> int:
        return self.count

    def joined(self) -> tuple:
        return tuple(_compat.concat(parts) for parts in zip(*self.chunks))

    def samples(self) -> list:
        return [sample for chunk in self.chunks for sample in chunk]


class _SwapDataset:
    """The dataset a long-lived thread/in-process DataLoader reads; swapped per shard."""

    def __init__(self) -> None:
        self.current: _ShardDataset | None = None

    def __len__(self) -> int:
        return len(self.current) if self.current is not None else 0

    def __getitem__(self, idx: int) -> Any:
        return self.current[idx]


class _BatchList:
    """A batch sampler whose batches are set per shard."""

    def __init__(self) -> None:
        self.batches: list = []

    def __iter__(self) -> Iterator[list]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class _LoaderResources:
    """What a StreamLoader owns: its stream and any DataLoader worker pool."""

    def __init__(self, stream: ShardStream, owns_stream: bool) -> None:
        self.stream = stream
        self.owns_stream = owns_stream
        self.dataloaders: set = set()
        self.closed = False

    def release(self, dataloader: Any) -> None:
        self.dataloaders.discard(dataloader)
        _compat.release_dataloader(dataloader)

    def close(self) -> None:
        self.closed = True
        for dataloader in list(self.dataloaders):
            self.release(dataloader)
        if self.owns_stream:
            self.stream.close()


class StreamLoader(Closing):
    """Iterate full, shuffled batches over shards produced on demand.

    Args:
        source: A source (``CommandSource``, ``FunctionSource``, ``FileSource``) or a
            :class:`ShardStream`. With a stream, set ``transform``/``shuffle``/``seed``/
            ``prefetch``/``producers``/``on_error``/``schema`` on the stream.
        batch_size: Samples per batch.
        transform: ``transform(raw) -> arrays`` per shard, in a background producer thread.
        sample_transform: ``fn(*sample) -> sample`` per sample (like ``Dataset.transform``);
            selects the DataLoader path.
        shuffle: Shuffle shard order and samples within shards, from ``(seed, epoch)``.
        seed: Shuffle seed (None: drawn once, logged).
        last_batch: ``'keep'`` (default, as Gluon), ``'discard'`` or ``'rollover'``; applies at
            the end of the epoch only, leftovers always cross shard boundaries.
        num_workers, thread_pool, batchify_fn, pin_memory, pin_device_id, timeout: As in
            ``gluon.data.DataLoader``; ``thread_pool=None`` means threads (no fork per shard)
            unless set to False. Without ``batchify_fn``/``sample_transform`` batches are
            slices and no workers are needed.
        prefetch: Shards produced ahead of the one being consumed.
        producers: Shards produced in parallel (threads), or a ``concurrent.futures.Executor``
            (e.g. a dask client's) that generates them into a shared ``cache_dir``.
        on_error: ``'raise'``, ``'skip'`` or ``('retry', n)`` per shard.
        schema: Expected ``[(dtype, trailing_shape), ...]``; default: the first shard's.
        stats: A :class:`Stats` to record into (default: a new one, ``loader.stats``).
        progress: Show a tqdm bar per epoch (samples/s, share of time waiting, shards ahead).
        num_parts, part_index: This rank's part of every epoch's shards (MXNet's names);
            ``'auto'`` reads them from ``kvstore``, Horovod or the launcher's environment.
        kvstore: An MXNet kvstore to read the rank from with ``'auto'``.
        even_batches: Every part yields the same number of full batches per epoch (the
            smallest part's count; the few samples beyond it wait for another epoch, dealt
            differently), so synchronous training never waits on a rank that ran out.
        shard_sizes: ``{key: samples}`` or ``fn(key)`` after ``transform``, when file headers
            cannot tell (for ``len()`` and ``even_batches``).

    Example:
        >>> import numpy as np
        >>> from gluon_stream import FunctionSource
        >>> src = FunctionSource(range(3), lambda k: np.arange(10.0))
        >>> with StreamLoader(src, batch_size=4) as loader:
        ...     [len(b) for b in loader]
        [4, 4, 4, 4, 4, 4, 4, 2]
    """

    def __init__(self, source: Source | ShardStream, batch_size: int, *,
                 transform: Callable[[Any], Any] | None = None,
                 sample_transform: Callable[..., Any] | None = None,
                 shuffle: bool = False, seed: int | None = None, last_batch: str = "keep",
                 num_workers: int = 0, thread_pool: bool | None = None,
                 batchify_fn: Callable[[list], Any] | None = None, pin_memory: bool = False,
                 pin_device_id: int = 0, timeout: float = 120, prefetch: int = 2,
                 producers: int | Executor = 1, on_error: Any = "raise",
                 schema: Sequence[tuple[Any, Sequence[int]]] | None = None,
                 stats: Stats | None = None, progress: bool = False,
                 num_parts: int | str = 1, part_index: int | str = 0, kvstore: Any = None,
                 even_batches: bool = False,
                 shard_sizes: Mapping[Any, int] | Callable[[Any], int] | None = None) -> None:
        _compat.require_mxnet()
        if not isinstance(batch_size, (int, np.integer)) or isinstance(batch_size, bool) \
                or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if last_batch not in LAST_BATCH_MODES:
            raise ValueError(f"last_batch must be one of {LAST_BATCH_MODES}, got {last_batch!r}")
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be an integer >= 0, got {num_workers!r}")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
        if even_batches and last_batch == "rollover":
            raise ValueError("even_batches=True delivers only full batches, so last_batch='rollover' "
                             "has nothing to roll over; use last_batch='keep' or 'discard'")
        for name, fn in (("sample_transform", sample_transform), ("batchify_fn", batchify_fn)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be callable, got {type(fn).__name__}")
        if isinstance(source, ShardStream):
            given = {"transform": transform is not None, "shuffle": shuffle, "seed": seed is not None,
                     "prefetch": prefetch != 2, "producers": producers != 1,
                     "on_error": on_error != "raise", "schema": schema is not None,
                     "stats": stats is not None, "num_parts": num_parts != 1,
                     "part_index": part_index != 0, "kvstore": kvstore is not None,
                     "shard_sizes": shard_sizes is not None}
            clash = [name for name, set_ in given.items() if set_]
            if clash:
                raise ValueError(f"{', '.join(clash)} given to StreamLoader together with a "
                                 "ShardStream: set them on the ShardStream instead")
            stream, owns = source, False
        else:
            stream = ShardStream(source, transform=transform, prefetch=prefetch,
                                 producers=producers, shuffle=shuffle, seed=seed,
                                 on_error=on_error, schema=schema, stats=stats,
                                 num_parts=num_parts, part_index=part_index, kvstore=kvstore,
                                 shard_sizes=shard_sizes)
            owns = True
        self.batch_size = int(batch_size)
        self.even_batches = bool(even_batches)
        self.last_batch = last_batch
        self.num_workers = num_workers
        self.thread_pool = thread_pool
        self.batchify_fn = batchify_fn
        self.sample_transform = sample_transform
        self.pin_memory = pin_memory
        self.pin_device_id = pin_device_id
        self.timeout = timeout
        self.stream = stream
        self.progress = progress
        self.vectorised = batchify_fn is None and sample_transform is None
        self._rollover: _Carry | None = None
        self._position: dict | None = None  # where the epoch in progress stands
        self._resume: dict | None = None  # set by load_state_dict for the next pass
        self._finished_epoch: int | None = None
        self._swap = _SwapDataset()
        self._batch_list = _BatchList()
        self._shared_dataloader: Any = None
        self._res = _LoaderResources(stream, owns)
        self._finalizer = weakref.finalize(self, self._res.close)
        if self.vectorised:
            ctx = _compat.context(pin_memory, pin_device_id)
            stream._finisher = lambda shard, order: _to_ndarrays(shard, ctx, order)
            if num_workers:
                logger.info("num_workers=%d unused: without batchify_fn/sample_transform, batches "
                            "are slices of a shard prepared in the background", num_workers)

    # -- public API -----------------------------------------------------------------------
    @property
    def stats(self) -> Stats:
        """Per-shard and per-epoch records (see :class:`Stats`)."""
        return self.stream.stats

    @property
    def epoch(self) -> int:
        """The epoch the next iteration will produce."""
        return self.stream.epoch

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch of the next pass (its keys, shuffle order and cache entries)."""
        self.stream.set_epoch(epoch)

    def __len__(self) -> int:
        count = self._num_batches(self.stream.epoch)
        if count is None:
            raise TypeError("len(StreamLoader) is unknown: the keys are an iterator, or shard sizes "
                            "are not known yet (a transform changes them); iterate one epoch first")
        return count

    def _num_batches(self, epoch: int) -> int | None:
        total = self.stream.epoch_size(epoch)
        if total is None:
            return None
        full, rest = divmod(total + _carry_len(self._rollover), self.batch_size)
        return full + (1 if rest and self.last_batch == "keep" else 0)

    def __iter__(self) -> Iterator[Any]:
        self._check_open()
        resume = self._resume
        if resume is not None and resume["epoch"] != self.stream.epoch:
            logger.warning("state loaded for epoch %d, but epoch %d starts: iterating it from its "
                           "beginning", resume["epoch"], self.stream.epoch)
            self._resume = resume = None
        run = self.stream.start_epoch(skip=resume["shard"] if resume else 0)
        return self._epoch(run)

    STATE_VERSION = 1

    def state_dict(self) -> dict:
        """Where the stream stands, as a small JSON-serialisable dict (take it between batches).

        A fresh loader with the same arguments continues, after :meth:`load_state_dict`, with
        exactly the batches this one would have produced next.
        """
        if self._position is not None:
            position = dict(self._position, carry=list(self._position["carry"]))
        else:
            epoch = self.stream.epoch
            if epoch == self._finished_epoch:  # set_epoch(e) then a whole pass: e + 1 is next
                epoch += 1
            position = {"epoch": epoch, "shard": 0, "offset": 0, "batches": 0,
                        "carry": list(self._rollover.segments) if self._rollover else []}
        return dict(position, version=self.STATE_VERSION, seed=self.stream.seed,
                    shuffle=self.stream.shuffle, batch_size=self.batch_size,
                    num_parts=self.stream.num_parts, part_index=self.stream.part_index)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict` of a loader built with the same arguments."""
        expected = {"version": self.STATE_VERSION, "seed": self.stream.seed,
                    "shuffle": self.stream.shuffle, "batch_size": self.batch_size,
                    "num_parts": self.stream.num_parts, "part_index": self.stream.part_index}
        missing = {"epoch", "shard", "offset", "batches", "carry"} - set(state)
        if missing:
            raise ValueError(f"not a StreamLoader state: missing {sorted(missing)}")
        differ = {k: (state.get(k), v) for k, v in expected.items() if state.get(k) != v}
        if differ:
            raise ValueError(f"state was saved by a loader with other settings "
                             f"(saved, this one): {differ}; build the loader as before")
        self._resume = {k: state[k] for k in ("epoch", "shard", "offset", "batches", "carry")}
        self._rollover = None
        self.stream.set_epoch(int(state["epoch"]))

    def _rebuild_carry(self, segments: list) -> _Carry | None:
        """Produce the shards that carried samples came from again, and cut the same rows."""
        if not segments:
            return None
        carry = _Carry()
        key_lists: dict[int, list | None] = {}
        for seg in segments:
            epoch = int(seg["epoch"])
            if epoch not in key_lists:
                key_lists[epoch] = self.stream.epoch_keys(epoch)[2]
            keys = key_lists[epoch]
            key = keys[seg["index"]] if keys is not None else seg["key"]
            shard = self.stream.produce_now(key, epoch)
            start, end = int(seg["start"]), int(seg["end"])
            if self.vectorised:
                chunk = tuple(a[start:end].copy() for a in shard.arrays)
            else:
                chunk = [_row(shard.arrays, i) for i in range(start, end)]
            carry.add(chunk, dict(seg), end - start)
        return carry

    def close(self) -> None:
        """Stop producers, end worker pools, kill generators, remove temp files; idempotent."""
        self._finalizer()

    # -- one epoch ------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._res.closed:
            raise LoaderClosed("this StreamLoader is closed; create a new one")
        self.stream.check_open()

    def _epoch(self, run: _EpochRun) -> Iterator[Any]:
        stats = self.stats
        clock = stats.clock
        record = stats.new_epoch(run.epoch)
        start = waiting_since = clock()
        bar = ProgressBar(run.epoch, self._num_batches(run.epoch)) if self.progress else None
        limit = self._even_limit(run.epoch)
        resume, self._resume = self._resume, None
        delivered = resume["batches"] if resume else 0
        if resume:
            carry = self._rebuild_carry(resume["carry"])
            offset = resume["offset"]
        else:
            carry, offset = self._rollover, 0
        self._rollover = None
        position = self._position = {"epoch": run.epoch, "shard": run.index, "offset": offset,
                                     "carry": carry.segments if carry else [],
                                     "batches": delivered}
        batches = self._slice_batches if self.vectorised else self._dataloader_batches
        run.start()  # producers start on the first shards before anything below can wait
        if not self.vectorised and self._shares_dataloader:
            self._ensure_shared_dataloader()  # its gc.collect() overlaps the first generation
        try:
            for batch in batches(run, carry, offset, record, position):
                if limit is not None and delivered >= limit:
                    break  # even_batches: every part stops after the same number of batches
                now = clock()
                if record.first_batch_s is None:
                    record.first_batch_s = now - start
                record.stall_s += now - waiting_since
                if run.rotation_start is not None:  # first batch after a shard boundary
                    record.rotation_s.append(max(0.0, now - run.rotation_start - run.rotation_wait))
                    run.rotation_start, run.rotation_wait = None, 0.0
                stats.add_span("train", "wait", waiting_since, now)
                record.batches += 1
                record.samples += _batch_len(batch)
                delivered += 1
                position["batches"] = delivered
                if bar is not None:
                    record.wall_s = now - start
                    bar.update(record, run.ready_ahead())
                yield batch
                waiting_since = clock()
                stats.add_span("train", "busy", now, waiting_since)
            record.complete = True
            self._position = None
            self._finished_epoch = run.epoch
        finally:
            run.cancel()
            record.skipped_shards = run.skipped
            record.wall_s = clock() - start
            if bar is not None:
                bar.close(record)

    def _even_limit(self, epoch: int) -> int | None:
        """With even_batches, the batch count every part can deliver this epoch."""
        if not self.even_batches:
            return None
        sizes = self.stream.part_sizes(epoch)
        if sizes is None:
            raise TypeError(
                f"even_batches=True needs every shard's size for epoch {epoch} on every rank: use "
                "FileSource or a shared cache_dir filled ahead (gluon-stream generate), or pass "
                "shard_sizes= (samples after transform)")
        return min(sizes) // self.batch_size

    def _shards(self, run: _EpochRun, record: EpochRecord) -> Iterator["Shard | _ShardFailed"]:
        """The epoch's shards; marks each boundary so ``_epoch`` can time the rotation."""
        clock = self.stats.clock
        first = True
        while True:
            t0 = clock()
            try:
                shard = run.next_shard()
            except LoaderClosed:
                raise
            except Exception as exc:  # the paths deliver what earlier shards left over first
                yield _ShardFailed(exc)
                return
            if shard is None:
                return
            record.peak_prefetch = max(record.peak_prefetch, run.ready_ahead() + 1)
            if not first:
                if run.rotation_start is None:
                    run.rotation_start = t0
                run.rotation_wait += run.last_wait_s
            first = False
            yield shard
            del shard

    def _slice_batches(self, run: _EpochRun, carry: _Carry | None, offset: int,
                       record: EpochRecord, position: dict) -> Iterator[Any]:
        bs = self.batch_size
        for shard in self._shards(run, record):
            if isinstance(shard, _ShardFailed):
                yield from self._flush_before(shard.error, carry, _joined_batch, position)
            arrays = shard.arrays
            n = len(shard)
            pos, offset = offset, 0  # a resumed epoch starts its first shard at the offset
            if carry is not None and pos < n:
                take = min(bs - len(carry), n - pos)
                carry.add(tuple(a[pos:pos + take] for a in arrays),
                          _segment(shard, pos, pos + take), take)
                pos += take
                if len(carry) < bs:
                    continue
                _advance(position, shard, pos)
                yield _as_batch(carry.joined())
                carry = None
            stop = pos + (n - pos) // bs * bs
            for begin in range(pos, stop, bs):
                _advance(position, shard, begin + bs)
                yield _as_batch(tuple(a[begin:begin + bs] for a in arrays))
            if stop < n:  # copy: a small leftover must not keep the whole shard alive
                carry = _Carry()
                carry.add(tuple(a[stop:n].copy() for a in arrays), _segment(shard, stop, n),
                          n - stop)
            del arrays
        yield from self._finish_epoch(carry, _joined_batch, run, position)

    def _dataloader_batches(self, run: _EpochRun, carry: _Carry | None, offset: int,
                            record: EpochRecord, position: dict) -> Iterator[Any]:
        bs = self.batch_size

        def last(c: _Carry) -> Any:
            dataset = _ShardDataset(c.samples(), (), self.sample_transform)
            with contextlib.closing(self._run_dataloader(dataset, [list(range(len(dataset)))])
                                    ) as out:
                return next(out)

        for shard in self._shards(run, record):
            if isinstance(shard, _ShardFailed):
                yield from self._flush_before(shard.error, carry, last, position)
            pos, offset = offset, 0
            n = len(shard)
            held = len(carry) if carry is not None else 0
            samples = carry.samples() if carry is not None else []
            stop = (held + n - pos) // bs * bs
            if not stop:  # too few to finish a batch: everything waits for the next shard
                if pos < n:
                    carry = carry or _Carry()
                    carry.add([_row(shard.arrays, i) for i in range(pos, n)],
                              _segment(shard, pos, n), n - pos)
                continue
            dataset = _ShardDataset(samples, shard.arrays, self.sample_transform, start=pos)
            rest = pos + stop - held  # shard row of the first sample left over
            carry = None
            if rest < n:
                carry = _Carry()
                carry.add([_row(shard.arrays, i) for i in range(rest, n)],
                          _segment(shard, rest, n), n - rest)
            batches = [list(range(i, i + bs)) for i in range(0, stop, bs)]
            with contextlib.closing(self._run_dataloader(dataset, batches, key=shard.key)) as out:
                for end, batch in zip(range(bs, stop + 1, bs), out):
                    _advance(position, shard, pos + end - held)
                    yield batch
            del dataset, shard
        yield from self._finish_epoch(carry, last, run, position)

    def _flush_before(self, error: BaseException, carry: _Carry | None,
                      as_batch: Callable[[Any], Any], position: dict) -> Iterator[Any]:
        """A shard failed: deliver the samples earlier shards left over, then raise its error."""
        if carry is not None and len(carry) and self.last_batch != "discard":
            position["carry"] = []
            yield as_batch(carry)
        raise error

    def _finish_epoch(self, carry: _Carry | None, as_batch: Callable[[Any], Any],
                      run: _EpochRun, position: dict) -> Iterator[Any]:
        position.update(shard=run.index, offset=0, carry=carry.segments if carry else [])
        if carry is None or not len(carry):
            return
        if self.last_batch == "keep":
            position["carry"] = []
            yield as_batch(carry)
        elif self.last_batch == "rollover":
            self._rollover = carry

    @property
    def _shares_dataloader(self) -> bool:
        """Threads or no workers: one DataLoader serves every shard (no fork per shard)."""
        return self.num_workers == 0 or self.thread_pool is None or bool(self.thread_pool)

    def _batchify(self) -> Callable[[list], Any]:
        return self.batchify_fn or _compat.default_batchify_fn()

    def _ensure_shared_dataloader(self) -> None:
        """Build the long-lived DataLoader once; its constructor runs gc.collect() (~50 ms)."""
        if self._shared_dataloader is None:
            self._shared_dataloader = _compat.make_dataloader(
                self._swap, self._batch_list, batchify_fn=self._batchify(),
                num_workers=self.num_workers, thread_pool=True, pin_memory=self.pin_memory,
                pin_device_id=self.pin_device_id, timeout=self.timeout)
            self._res.dataloaders.add(self._shared_dataloader)

    def _run_dataloader(self, dataset: _ShardDataset, batches: list, key: Any = None
                        ) -> Iterator[Any]:
        batchify = self._batchify()
        if self._shares_dataloader:
            self._ensure_shared_dataloader()
            self._swap.current = dataset
            self._batch_list.batches = batches
            try:
                yield from _thread_batches(self._shared_dataloader, self.timeout, key, len(batches))
            finally:
                if self._swap.current is dataset:  # a late close must not clear a newer shard
                    self._swap.current = None
            return
        # A process pool (thread_pool=False) is forked per shard and driven by _pool_batches,
        # which notices a dead worker (MXNet would wait for its lost batch forever) and a slow
        # batch. With on_error=('retry', n) the undelivered batches are redone in a fresh pool,
        # so every sample is still delivered exactly once.
        retries = self.stream._retries if self.stream.on_error == "retry" else 0
        done = 0
        for attempt in range(retries + 1):
            sampler = _BatchList()
            sampler.batches = batches[done:]
            dataloader = _compat.make_dataloader(
                dataset, sampler, batchify_fn=batchify, num_workers=self.num_workers,
                thread_pool=False, pin_memory=self.pin_memory, pin_device_id=self.pin_device_id,
                timeout=self.timeout)
            self._res.dataloaders.add(dataloader)
            try:
                for batch in _pool_batches(dataloader, sampler.batches, self.timeout, key,
                                           first=done, total=len(batches)):
                    done += 1
                    yield batch
                    del batch  # a kept exception's frames must not pin shared-memory batches
                return
            except WorkerDied as exc:
                if attempt == retries:
                    raise
                logger.warning("%s; redoing the %d undelivered batch(es) in a new worker pool "
                               "(retry %d/%d)", str(exc), len(batches) - done, attempt + 1,
                               retries)
            finally:
                self._res.release(dataloader)


def _to_ndarrays(shard: Shard, ctx: Any, order: np.ndarray | None) -> None:
    """Producer-side: replace a shard's numpy arrays by NDArrays holding its rows in ``order``
    (one copy, off the training loop's path)."""
    if len(shard):
        shard.arrays = tuple(_compat.to_ndarray(a, ctx, order) for a in shard.arrays)


def _row(arrays: Sequence[Any], i: int) -> tuple:
    """One sample as a tuple of copied rows (a carried sample must not pin its shard)."""
    return tuple(np.array(a[i]) for a in arrays)


def _segment(shard: Shard, start: int, end: int) -> dict:
    """Where carried samples came from: enough to produce them again on resume."""
    key = shard.key if isinstance(shard.key, (str, int, float)) else str(shard.key)
    return {"epoch": shard.epoch, "index": shard.index, "key": key, "start": start, "end": end}


def _advance(position: dict, shard: Shard, offset: int) -> None:
    """Record that the next sample to read is row ``offset`` of ``shard`` (nothing carried)."""
    if offset >= len(shard):
        position.update(shard=shard.index + 1, offset=0, carry=[])
    else:
        position.update(shard=shard.index, offset=offset, carry=[])


class _ShardFailed:
    """Stands in the shard sequence for a shard whose production failed."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _joined_batch(carry: _Carry) -> Any:
    return _as_batch(carry.joined())


def _as_batch(arrays: tuple) -> Any:
    return arrays[0] if len(arrays) == 1 else list(arrays)


def _batch_len(batch: Any) -> int:
    first = batch[0] if isinstance(batch, (list, tuple)) else batch
    return int(first.shape[0])


def _carry_len(carry: _Carry | None) -> int:
    return len(carry) if carry is not None else 0


# -- worker pools: dead workers and slow batches (helpers of StreamLoader._run_dataloader) --------

POOL_POLL_S = 0.1  # how often a wait for a process-pool batch checks for dead workers
WORKER_DEATH_S = 5.0  # how long a failed fetch from a worker waits for its death to show


def _describe_key(key: Any) -> str:
    return f"shard {key!r}" if key is not None else "the current shard"


def _pool_batches(dataloader: Any, batches: list, timeout: float, key: Any, *, first: int,
                  total: int) -> Iterator[Any]:
    """Yield a process-pool DataLoader's batches in order, as MXNet's iterator would, but
    sleeping in short slices that check whether a worker died and whether ``timeout`` passed."""
    known: dict = {}
    _compat.dead_workers(dataloader, known)  # remember the workers forked for this shard
    pending: collections.deque = collections.deque()
    todo = iter(enumerate(batches, start=first))

    def push() -> None:
        item = next(todo, None)
        if item is not None:
            pending.append((item[0], _compat.submit_batch(dataloader, item[1])))

    for _ in range(_compat.prefetch_depth(dataloader)):
        push()
    while pending:
        index, result = pending.popleft()
        push()
        deadline = time.monotonic() + timeout
        while not result.ready():
            result.wait(POOL_POLL_S)
            if result.ready():
                break
            if _compat.worker_pool(dataloader) is None:  # released: close() from another thread
                raise LoaderClosed(f"the loader was closed while waiting for batch {index + 1} "
                                   f"of {total} of {_describe_key(key)}")
            dead = _compat.dead_workers(dataloader, known)
            if dead:
                raise _worker_died(dead, key, index, total)
            if time.monotonic() >= deadline:
                raise BatchTimeout(
                    f"batch {index + 1} of {total} of {_describe_key(key)} took longer than "
                    f"timeout={timeout} s in a DataLoader worker process: sample_transform or "
                    "batchify_fn is too slow (or stuck); speed it up or raise timeout=")
        try:
            batch = _compat.receive_batch(dataloader, result)
        except Exception as exc:
            # the shared-memory fd of a finished batch is fetched from the worker that made it:
            # if that worker was just killed, this fails before its death is visible here
            patience = WORKER_DEATH_S if isinstance(exc, (OSError, EOFError)) else 0.0
            dead = _compat.dead_workers(dataloader, known)
            deadline = time.monotonic() + patience
            while not dead and time.monotonic() < deadline:
                time.sleep(POOL_POLL_S)
                dead = _compat.dead_workers(dataloader, known)
            if dead:
                raise _worker_died(dead, key, index, total) from exc
            exc.add_note(f"gluon_stream: raised in a DataLoader worker process while loading "
                         f"batch {index + 1} of {total} of {_describe_key(key)}")
            raise
        del result
        yield batch
        del batch  # a kept exception's frames must not pin shared-memory batches


def _worker_died(dead: list, key: Any, index: int, total: int) -> Exception:
    pid, code = dead[0]
    if code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code}"
    return WorkerDied(
        f"DataLoader worker process {pid} {how} while {_describe_key(key)} was loading; batch "
        f"{index + 1} of {total} and the others it held are lost. Likely out of memory (check "
        "`dmesg` for the OOM killer) or a crash in sample_transform/batchify_fn: lower "
        "num_workers, use thread_pool=True, or pass on_error=('retry', n) to redo the lost "
        "batches in a new pool", pid=pid, signal=-code if code < 0 else None, key=key)


def _thread_batches(dataloader: Any, timeout: float, key: Any, total: int) -> Iterator[Any]:
    """A thread-pool or in-process DataLoader's batches, its timeout raised as BatchTimeout."""
    batches = iter(dataloader)
    try:
        index = 0
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except multiprocessing.TimeoutError as exc:
                raise BatchTimeout(
                    f"batch {index + 1} of {total} of {_describe_key(key)} took longer than "
                    f"timeout={timeout} s in a DataLoader worker thread: sample_transform or "
                    "batchify_fn is too slow (or stuck); speed it up or raise timeout=") from exc
            index += 1
            yield batch
    finally:
        batches.close()
