"""The contracts between the loader's stages, as ``typing.Protocol`` s that mypy checks.

A pass (:mod:`gluon_stream._stages.epoch`) drives a :class:`BatchPath` (planned batches into data:
slices of a unit, or per-sample work); the per-sample path drives :class:`Workers` (inline,
threads or processes); a pass's shards come from an :class:`~gluon_stream.stream.KeyPass`,
which drives the stream's producer side through
:class:`gluon_stream._stages.produce.ShardMaker` (it lives beside the run: these contracts name
the feed's types, which name the run). The shard cache's contract is
:class:`gluon_stream._cache.ShardCache`; a source's is :class:`gluon_stream.Source`. Each
implementation is checked against its Protocol where it is built (an assignment to the
Protocol's type), so two implementations cannot drift apart in arity unnoticed.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol, Sequence

if TYPE_CHECKING:
    import concurrent.futures as cf

    from .batching import Batch, Segment
    from .feed import Carry, MixedData, UnitFeed
    from .produce import Prepare

__all__ = ["BatchPath", "Workers"]


class Workers(Protocol):
    """Makes batches from sample references (``[(source id, rows), ...]``), ahead of the loop.

    Attributes:
        depth: Batches worth keeping in flight.
        uses_shared_memory: Sources are attached as shared memory (worker processes).
    """

    depth: int
    uses_shared_memory: bool

    def attach(self, sid: int, arrays: Sequence[Any]) -> None:
        """Make a shard's arrays known as source ``sid``."""

    def detach(self, sid: int) -> None:
        """Source ``sid`` is read no more."""

    def submit(self, tid: int, refs: Sequence[tuple[int, Any]], what: str = "",
               key: Any = None, seed: int | None = None) -> None:
        """Start batch ``tid``, the global RNGs seeded from ``seed`` (None: not seeded)."""

    def result(self, tid: int, timeout: float, what: str = "") -> Any:
        """Batch ``tid``'s data, once made (its error, raised, if it failed)."""

    def done(self, tid: int) -> bool:
        """Whether :meth:`result` would return without waiting."""

    def new_epoch(self) -> None:
        """An epoch's batches begin: per-epoch budgets start afresh."""

    def cancel_all(self) -> None:
        """Forget every batch not yet taken, and every source."""

    def close(self) -> None:
        """End the workers; idempotent."""


class BatchPath(Protocol):
    """Planned batches into data, over the units of a feed.

    Attributes:
        prepare: What the producer threads run on each shard (None: numpy rows as they are).
        wait_s: Seconds the loop waited for batches to be made, in total.
    """

    prepare: "Prepare | None"
    wait_s: float

    def batches(self, feed: UnitFeed, carry: Carry, first: int = 0,
                seed_of: Callable[[int], int] | None = None) -> Iterator[tuple[Batch, Any]]:
        """``(planned batch, data)`` in order; batch ``first + i`` seeded from ``seed_of``."""

    def cut(self, unit: Any, segment: Segment) -> tuple:
        """A copy of a unit's rows in ``segment`` (carried into the next batch)."""

    def mix(self, mixed: MixedData) -> MixedData:
        """A shuffle window's unit with its data gathered from its shards."""

    def mix_later(self, mixed: MixedData) -> cf.Future:
        """:meth:`mix`, off the loop's thread."""

    def join(self, chunks: list[tuple], seed: int | None = None) -> Any:
        """A batch of carried chunks, e.g. a batch made again on resume."""

    def ready(self) -> bool:
        """Whether the next batch comes without waiting."""

    def close(self) -> None:
        """End what the path owns (a mixing thread, workers); idempotent."""
