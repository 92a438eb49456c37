"""ShardStream: shards in order, produced ahead of the consumer by a bounded thread pool.

The public names of a stream and what it hands out. The stream wires the chain's first
stages (the keys' deal and production, in :mod:`gluon_stream._stages`): see
:class:`ShardStream`.
"""
from __future__ import annotations

from ._stages.produce import KeyPass, Prepare, RunState, Shard, ShardStream

__all__ = ["EpochRun", "KeyPass", "Prepare", "RunState", "Shard", "ShardStream"]

#: the name of :class:`KeyPass` before 0.2 (one pass over an epoch's keys, not a loader's epoch)
EpochRun = KeyPass
