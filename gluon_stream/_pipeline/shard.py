"""One ready shard, and the ``prepare`` step that puts its arrays in the consumer's form.

Both are what a :class:`~gluon_stream.ShardStream` hands a pass (:mod:`.run`) and what the
stages after it read; they live below both so that the contracts can name them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .._mx import import_mxnet
from ..records import ShardRecord

__all__ = ["Owned", "Prepare", "Shard", "owned_each"]

#: ``prepare(arrays, order, what) -> arrays``: run in the producer thread after the transform,
#: it returns the shard's arrays in ``order`` (a permutation or a subset of the rows, or None)
#: in whatever form the consumer wants them (NDArrays, shared memory, ...); ``what`` names the
#: shard (key, file, epoch) for its error messages. ``arrays`` is an :class:`Owned` tuple when
#: the loader owns them: ``prepare`` may then free or reuse their memory (nothing else holds
#: them); any other tuple's arrays belong to user code and must be left as they are.
Prepare = Callable[[tuple, "np.ndarray | None", str], tuple]


class Owned(tuple):
    """A shard's arrays that the loader owns, handed to ``prepare`` (a plain tuple otherwise).

    Ownership is carried as data from where the arrays are made: the loader read them from a
    file itself (a cache, a ``FileSource`` file, a ``CommandSource``'s output; not
    memory-mapped), or a ``FunctionSource(fresh_arrays=True)`` handed its function's result
    over, and no ``transform`` ran (a transform's output is user code's). Nothing infers it
    later: reference counts do not see weak references."""

    __slots__ = ()


def owned_each(arrays: tuple) -> list[bool]:
    """For each array of ``arrays``, whether the loader owns it (the whole tuple is
    :class:`Owned`, or none of it is)."""
    return [isinstance(arrays, Owned)] * len(arrays)


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
    #: its rows and ``[(dtype, trailing shape)]``, taken where it was made (a producer thread):
    #: read from NDArrays in the loop's thread, each is a C call that releases the GIL and
    #: may wait for it behind a busy producer, a few hundred us at a shard boundary
    rows: int = -1
    schema: list | None = field(repr=False, default=None)
    #: bytes of its raw and transformed arrays, alive beside its copy while it was made
    source_nbytes: int = 0
    #: its memory admitted against ``memory_budget`` (a ``_pipeline.admission.Admission``),
    #: given back when the shard is freed; None without a budget
    admission: Any = field(repr=False, default=None)
    #: provenance=True: its key, made-for epoch and raw row of each row read
    #: (a ``_pipeline.provenance.ShardOrigin``); None otherwise
    origin: Any = field(repr=False, default=None)

    def __len__(self) -> int:
        return self.rows if self.rows >= 0 else int(self.arrays[0].shape[0])

    @property
    def dataset(self) -> Any:
        """A ``gluon.data.ArrayDataset`` over the shard's arrays."""
        return import_mxnet().gluon.data.ArrayDataset(*self.arrays)
