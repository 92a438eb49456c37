"""What a loader decides for every pass (batch size, the last batch's rule, the shuffle window,
even_batches, placement, an epoch's samples): read by the pass and its stages."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["PassSettings"]


@dataclass(frozen=True)
class PassSettings:
    """What a loader decides for every pass."""

    batch_size: int
    last_batch: str
    window: int  # shuffle_window
    even: bool | str  # even_batches: False, True or 'pad'
    progress: bool | str = False
    ctx: Any = None  # place batches here (None: where the path makes them)
    epoch_samples: int | None = None  # samples_per_epoch
