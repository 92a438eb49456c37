"""The pipeline workload every contender runs, and the lower bounds of an epoch."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..._stages.keys import part_keys
from ..generator import generator_command

__all__ = ["Workload", "ideal_time", "wave_bound"]


@dataclass(frozen=True)
class Workload:
    """One pipeline workload: shards from the built-in generator, windows, a training step."""

    shards: int = 6
    rows: int = 2576
    inputs: int = 8
    time_steps: int = 16
    batch_size: int = 64
    delay: float = 0.0
    step: str = "sleep"
    step_ms: float = 8.0
    num_workers: int = 2
    producers: int = 2
    prefetch: int = 2
    seed: int = 0
    delay_factors: tuple[tuple[str, float], ...] = ()  # (key, factor): keys that sleep longer
    per_epoch: bool = False  # the generator makes new data every epoch

    @property
    def samples_per_shard(self) -> int:
        return max(0, self.rows - self.time_steps)

    @property
    def steps(self) -> int:
        """Full batches in one epoch when leftovers cross shard boundaries."""
        return self.shards * self.samples_per_shard // self.batch_size

    @property
    def shard_bytes(self) -> int:
        """Bytes of one transformed shard (windows and labels, float32)."""
        return self.samples_per_shard * (self.time_steps * self.inputs + 1) * 4

    def keys(self) -> list[str]:
        return [f"s{i:04d}" for i in range(self.shards)]

    def shard_order(self) -> list[str]:
        """The keys in the order a ``StreamLoader(shuffle=True, seed=self.seed)`` reads them in
        epoch 0: every contender takes the shards in this order, so the stragglers fall at the
        same places for all (and the ideal is computed over it)."""
        return part_keys(self.keys(), self.seed, 0, 1, 0, True, "shards")

    def command(self) -> list[str]:
        """The built-in generator's argv for this workload (``{key}``, ``{path}``, ``{epoch}``)."""
        return generator_command(self.rows, self.inputs, self.delay,
                                 delay_factors=dict(self.delay_factors),
                                 per_epoch=self.per_epoch)


def ideal_time(first_prep_s: float, generate_s: float, prep_s: float, step_s: float,
               steps: int, shards: int, producers: int) -> float:
    """The lower bound of an epoch with ``producers`` parallel generators (see module doc).

    Args:
        first_prep_s: The first shard's generate + load + transform seconds.
        generate_s: One shard's generation seconds (median).
        prep_s: One shard's load + transform seconds (median).
        step_s: One training step's seconds (median).
        steps: Training steps in the epoch.
        shards: Shards in the epoch.
        producers: Shards generated in parallel.

    Example:
        >>> ideal_time(1.0, 0.9, 0.1, 0.01, 600, 6, 2)
        7.0
    """
    per_shard = steps / max(shards, 1) * step_s
    return max(first_prep_s + steps * step_s,
               math.ceil(shards / producers) * generate_s + prep_s + per_shard)


def wave_bound(first_prep_s: float, generate_s: float, prep_s: float, step_s: float,
               steps: int, shards: int, producers: int) -> float:
    """Like :func:`ideal_time`, but the last wave of parallel generations finishes together.

    With every producer busy from the start, the last ``r = shards - producers * (waves - 1)``
    shards are all ready at ``waves * generate_s`` and their steps still follow, so no
    schedule beats this; :func:`ideal_time` counts one shard's steps there.

    Example:
        >>> wave_bound(1.0, 0.9, 0.1, 0.01, 600, 6, 2)
        7.0
    """
    waves = math.ceil(shards / producers)
    last_wave = shards - producers * (waves - 1)
    per_shard = steps / max(shards, 1) * step_s
    return max(first_prep_s + steps * step_s, waves * generate_s + prep_s + last_wave * per_shard)
