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

import logging
import weakref
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from . import _compat
from .errors import LoaderClosed
from .sources import Source
from .stats import EpochRecord, ProgressBar, Stats
from .stream import Shard, ShardStream, _EpochRun

__all__ = ["StreamLoader"]

logger = logging.getLogger(__name__)

LAST_BATCH_MODES = ("keep", "discard", "rollover")


class _ShardDataset:
    """A shard's arrays preceded by samples carried over from the previous shard."""

    def __init__(self, carry: list, arrays: Sequence[Any],
                 sample_transform: Callable[..., Any] | None) -> None:
        self.carry = carry
        self.arrays = tuple(arrays)
        self.sample_transform = sample_transform

    def __len__(self) -> int:
        return len(self.carry) + (len(self.arrays[0]) if self.arrays else 0)

    def raw(self, idx: int, copy: bool = False) -> tuple:
        if idx < len(self.carry):
            return self.carry[idx]
        i = idx - len(self.carry)
        return tuple(np.array(a[i]) if copy else a[i] for a in self.arrays)

    def __getitem__(self, idx: int) -> Any:
        item = self.raw(idx)
        if self.sample_transform is not None:
            return self.sample_transform(*item)
        return item[0] if len(item) == 1 else item


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


class StreamLoader:
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
        producers: Shards produced in parallel.
        on_error: ``'raise'``, ``'skip'`` or ``('retry', n)`` per shard.
        schema: Expected ``[(dtype, trailing_shape), ...]``; default: the first shard's.
        stats: A :class:`Stats` to record into (default: a new one, ``loader.stats``).
        progress: Show a tqdm bar per epoch (samples/s, share of time waiting, shards ahead).

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
                 producers: int = 1, on_error: Any = "raise",
                 schema: Sequence[tuple[Any, Sequence[int]]] | None = None,
                 stats: Stats | None = None, progress: bool = False) -> None:
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
        for name, fn in (("sample_transform", sample_transform), ("batchify_fn", batchify_fn)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be callable, got {type(fn).__name__}")
        if isinstance(source, ShardStream):
            given = {"transform": transform is not None, "shuffle": shuffle, "seed": seed is not None,
                     "prefetch": prefetch != 2, "producers": producers != 1,
                     "on_error": on_error != "raise", "schema": schema is not None,
                     "stats": stats is not None}
            clash = [name for name, set_ in given.items() if set_]
            if clash:
                raise ValueError(f"{', '.join(clash)} given to StreamLoader together with a "
                                 "ShardStream: set them on the ShardStream instead")
            stream, owns = source, False
        else:
            stream = ShardStream(source, transform=transform, prefetch=prefetch,
                                 producers=producers, shuffle=shuffle, seed=seed,
                                 on_error=on_error, schema=schema, stats=stats)
            owns = True
        self.batch_size = int(batch_size)
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
        self._rollover: Any = None
        self._swap = _SwapDataset()
        self._batch_list = _BatchList()
        self._shared_dataloader: Any = None
        self._res = _LoaderResources(stream, owns)
        self._finalizer = weakref.finalize(self, self._res.close)
        if self.vectorised:
            ctx = _compat.context(pin_memory, pin_device_id)
            stream._finisher = lambda shard: _to_ndarrays(shard, ctx)
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
        run = self.stream.start_epoch()
        return self._epoch(run)

    def close(self) -> None:
        """Stop producers, end worker pools, kill generators, remove temp files; idempotent."""
        self._finalizer()

    def __enter__(self) -> "StreamLoader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

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
        carry, self._rollover = self._rollover, None
        batches = (self._slice_batches if self.vectorised else self._dataloader_batches)
        try:
            for batch in batches(run, carry, record):
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
                if bar is not None:
                    record.wall_s = now - start
                    bar.update(record, run.ready_ahead())
                yield batch
                waiting_since = clock()
                stats.add_span("train", "busy", now, waiting_since)
            record.complete = True
        finally:
            run.cancel()
            record.skipped_shards = run.skipped
            record.wall_s = clock() - start
            if bar is not None:
                bar.close()

    def _shards(self, run: _EpochRun, record: EpochRecord) -> Iterator[Shard]:
        """The epoch's shards; marks each boundary so ``_epoch`` can time the rotation."""
        clock = self.stats.clock
        first = True
        while True:
            t0 = clock()
            shard = run.next_shard()
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

    def _slice_batches(self, run: _EpochRun, carry: Any, record: EpochRecord) -> Iterator[Any]:
        bs = self.batch_size
        for shard in self._shards(run, record):
            arrays = shard.arrays
            n = len(shard)
            pos = 0
            if carry is not None and n:
                pos = min(bs - len(carry[0]), n)
                carry = tuple(_compat.concat([c, a[0:pos]]) for c, a in zip(carry, arrays))
                if len(carry[0]) < bs:
                    continue
                yield _as_batch(carry)
                carry = None
            stop = pos + (n - pos) // bs * bs
            for begin in range(pos, stop, bs):
                yield _as_batch(tuple(a[begin:begin + bs] for a in arrays))
            if stop < n:  # copy: a small leftover must not keep the whole shard alive
                carry = tuple(a[stop:n].copy() for a in arrays)
            del arrays
        yield from self._finish_epoch(carry, _as_batch)

    def _dataloader_batches(self, run: _EpochRun, carry: Any, record: EpochRecord
                            ) -> Iterator[Any]:
        bs = self.batch_size
        carry = carry or []
        for shard in self._shards(run, record):
            dataset = _ShardDataset(carry, shard.arrays, self.sample_transform)
            stop = len(dataset) // bs * bs
            carry = [dataset.raw(i, copy=True) for i in range(stop, len(dataset))]
            if stop:
                yield from self._run_dataloader(dataset, [list(range(i, i + bs))
                                                          for i in range(0, stop, bs)])
            del dataset, shard

        def last(samples: list) -> Any:
            dataset = _ShardDataset(samples, (), self.sample_transform)
            return next(iter(self._run_dataloader(dataset, [list(range(len(samples)))])))

        yield from self._finish_epoch(carry or None, last)

    def _finish_epoch(self, carry: Any, as_batch: Callable[[Any], Any]) -> Iterator[Any]:
        if not _carry_len(carry):
            return
        if self.last_batch == "keep":
            yield as_batch(carry)
        elif self.last_batch == "rollover":
            self._rollover = carry

    def _run_dataloader(self, dataset: _ShardDataset, batches: list) -> Iterator[Any]:
        batchify = self.batchify_fn or _compat.default_batchify_fn()
        use_threads = self.thread_pool is None or self.thread_pool
        if self.num_workers == 0 or use_threads:
            if self._shared_dataloader is None:
                self._shared_dataloader = _compat.make_dataloader(
                    self._swap, self._batch_list, batchify_fn=batchify,
                    num_workers=self.num_workers, thread_pool=True, pin_memory=self.pin_memory,
                    pin_device_id=self.pin_device_id, timeout=self.timeout)
                self._res.dataloaders.add(self._shared_dataloader)
            self._swap.current = dataset
            self._batch_list.batches = batches
            try:
                yield from self._shared_dataloader
            finally:
                self._swap.current = None
            return
        sampler = _BatchList()
        sampler.batches = batches
        dataloader = _compat.make_dataloader(
            dataset, sampler, batchify_fn=batchify, num_workers=self.num_workers,
            thread_pool=False, pin_memory=self.pin_memory, pin_device_id=self.pin_device_id,
            timeout=self.timeout)
        self._res.dataloaders.add(dataloader)
        try:
            yield from dataloader
        finally:
            self._res.release(dataloader)


def _to_ndarrays(shard: Shard, ctx: Any) -> None:
    """Producer-side: replace a shard's numpy arrays by NDArrays (one copy, off the hot path)."""
    if len(shard):
        shard.arrays = tuple(_compat.to_ndarray(a, ctx) for a in shard.arrays)


def _as_batch(arrays: tuple) -> Any:
    return arrays[0] if len(arrays) == 1 else list(arrays)


def _batch_len(batch: Any) -> int:
    first = batch[0] if isinstance(batch, (list, tuple)) else batch
    return int(first.shape[0])


def _carry_len(carry: Any) -> int:
    if not carry:
        return 0
    if isinstance(carry, list):  # DataLoader path: a list of samples
        return len(carry)
    return int(carry[0].shape[0])
