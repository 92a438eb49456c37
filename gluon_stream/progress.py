"""Progress bars: one tqdm bar per epoch with samples/s, the share of time the loop waited for
data, and the shards already produced ahead."""
from __future__ import annotations

import time
from typing import Any

from .stats import EpochRecord

__all__ = ["ProgressBar", "make_tqdm"]


def make_tqdm(**kwargs: Any) -> Any:
    """A ``tqdm.auto`` bar without tqdm's monitor thread (which outlives the bar by seconds)."""
    from tqdm.auto import tqdm

    class _Tqdm(tqdm):  # type: ignore[misc, valid-type]
        monitor_interval = 0

    return _Tqdm(**kwargs)


class ProgressBar:
    """A tqdm bar for one epoch: batches, samples/s, the share of time the loop waited for data,
    and the shards already produced ahead.

    ``tqdm.auto`` renders a widget in Jupyter (with ipywidgets installed) and text in a
    terminal. ``StreamLoader(..., progress=True)`` creates one per epoch.

    Args:
        epoch: Shown as the bar's description.
        total: Batches in the epoch, if known.
        disable: As in tqdm: False shows the bar; None hides it when the output is not a
            terminal. An explicit ``progress=True`` shows it (the default False).
        file: Where to write (default: stderr).

    Example:
        >>> bar = ProgressBar(0, total=2, disable=True)
        >>> bar.update(EpochRecord(0, batches=1, samples=32, wall_s=0.5), ahead=1)
        >>> bar.close()
    """

    REFRESH_S = 0.2

    def __init__(self, epoch: int, total: int | None, *, disable: bool | None = False,
                 file: Any = None) -> None:
        self._bar = make_tqdm(total=total, desc=f"epoch {epoch}", unit="batch", leave=True,
                              dynamic_ncols=True, disable=disable, file=file)
        self._last = -float("inf")
        self._postfix: dict = {}
        self._record: EpochRecord | None = None

    def update(self, record: EpochRecord, ahead: int) -> None:
        """Advance by one batch; refresh samples/s, waiting share and shards ahead."""
        self._record = record
        now = time.monotonic()
        if now - self._last >= self.REFRESH_S:
            self._last = now
            self._set_postfix(record, ahead)
        self._bar.update(1)

    def _set_postfix(self, record: EpochRecord, ahead: int) -> None:
        wall = record.wall_s if record.wall_s > 0 else 1e-9
        self._postfix = {"samples/s": f"{record.samples / wall:,.0f}",
                         "waiting": f"{100.0 * record.stall_s / wall:.0f}%", "ahead": ahead}
        self._bar.set_postfix(self._postfix, refresh=False)

    @property
    def postfix(self) -> dict:
        """The figures shown last (samples/s, waiting share, shards ahead)."""
        return dict(self._postfix)

    def close(self, record: EpochRecord | None = None) -> None:
        """Show the epoch's final figures and close the bar.

        Args:
            record: The finished epoch's record; default: the one last passed to
                :meth:`update` (the loader completes it before closing the bar).
        """
        record = record if record is not None else self._record
        if record is not None:
            self._set_postfix(record, 0)
        self._bar.close()
