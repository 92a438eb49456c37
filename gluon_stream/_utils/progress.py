"""Progress bars: one tqdm bar per epoch with samples/s, the share of time the loop waited for
data, and the shards already produced ahead.

The bar redraws in place (``\\r``) only where someone watches it: a terminal or a Jupyter
notebook. Written to anything else (a log file, a pipe, CI output) it is one line per epoch,
when the epoch ends, instead of kilobytes of redraws; ``live=True`` forces the redraws.
"""
from __future__ import annotations

import sys
import time
from typing import Any

from ..records import EpochRecord

__all__ = ["ProgressBar", "make_tqdm"]


def make_tqdm(**kwargs: Any) -> Any:
    """A ``tqdm.auto`` bar without tqdm's monitor thread (which outlives the bar by seconds)."""
    from tqdm.auto import tqdm

    class _Tqdm(tqdm):
        monitor_interval = 0

    return _Tqdm(**kwargs)


class ProgressBar:
    """A tqdm bar for one epoch: batches, samples/s, the share of time the loop waited for data,
    and the shards already produced ahead.

    ``tqdm.auto`` renders a widget in Jupyter (with ipywidgets installed) and text in a
    terminal. ``StreamLoader(..., progress=True)`` creates one per epoch. samples/s and the
    waiting share appear once the epoch has run for ``REFRESH_S`` (a rate over the first
    milliseconds says nothing); the final figures are shown when the bar closes.

    Args:
        epoch: Shown as the bar's description.
        total: Batches in the epoch, if known.
        disable: As in tqdm: False shows the bar; None hides it when the output is not a
            terminal or a notebook; True hides it.
        file: Where to write (default: stderr).
        live: Redraw in place as batches arrive. Default: only on a terminal or in a notebook;
            elsewhere one line is written when the epoch ends. True forces the redraws into any
            file, False always writes the one line.

    Example:
        >>> bar = ProgressBar(0, total=2, disable=True)
        >>> bar.update(EpochRecord(0, batches=1, samples=32, wall_s=0.5), ahead=1)
        >>> bar.close()
    """

    REFRESH_S = 0.2

    def __init__(self, epoch: int, total: int | None, *, disable: bool | None = False,
                 file: Any = None, live: bool | None = None) -> None:
        self._file = file if file is not None else sys.stderr
        watched = _in_notebook() or _is_terminal(self._file)
        self._hidden = bool(disable) or (disable is None and not watched)
        self._desc, self._total = f"epoch {epoch}", total
        self._last = -float("inf")
        self._postfix: dict = {}
        self._record: EpochRecord | None = None
        self._bar = self._shown = None
        if not self._hidden and (watched if live is None else live):
            self._bar, self._shown = _live_bar(desc=self._desc, total=total, unit="batch",
                                               leave=True, dynamic_ncols=True, file=self._file)

    def update(self, record: EpochRecord, ahead: int) -> None:
        """Advance by one batch; refresh samples/s, waiting share and shards ahead."""
        self._record = record
        now = time.monotonic()
        if now - self._last >= self.REFRESH_S:
            self._last = now
            self._set_postfix(record, ahead, final=False)
        if self._bar is not None:
            self._bar.update(1)

    def _set_postfix(self, record: EpochRecord, ahead: int, final: bool) -> None:
        self._postfix = {"ahead": ahead}
        if record.wall_s > 0 and (final or record.wall_s >= self.REFRESH_S):
            self._postfix = {"samples/s": f"{record.samples / record.wall_s:,.0f}",
                             "waiting": f"{100.0 * record.stall_s / record.wall_s:.0f}%",
                             "ahead": ahead}
        if self._bar is not None:
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
            self._set_postfix(record, 0, final=True)
        if self._bar is not None:
            self._bar.close()
            if self._shown is not None:  # the notebook's saved text: the final bar, not "0batch"
                self._shown.update(self._bar.container)
        elif not self._hidden and record is not None:
            from tqdm import tqdm

            postfix = ", ".join(f"{k}={v}" for k, v in self._postfix.items())
            self._file.write(tqdm.format_meter(record.batches, self._total, record.wall_s,
                                               prefix=self._desc, unit="batch",
                                               postfix=postfix) + "\n")
            self._file.flush()


def _live_bar(**kwargs: Any) -> tuple[Any, Any]:
    """A redrawing bar, and in Jupyter the display handle of its widget (else None).

    The widget is displayed with a display id so that closing the bar can replace the text
    a saved notebook shows for it (tqdm's is the empty bar it started as).
    """
    widget = _in_notebook() and _widget_bars()
    bar = make_tqdm(display=False, **kwargs) if widget else make_tqdm(**kwargs)
    if not widget:
        return bar, None
    from IPython.display import display

    return bar, display(bar.container, display_id=True)


def _widget_bars() -> bool:
    """Whether ``tqdm.auto`` draws ipywidgets (in a notebook, with ipywidgets installed)."""
    from tqdm.auto import tqdm

    notebook = sys.modules.get("tqdm.notebook")
    return notebook is not None and issubclass(tqdm, notebook.tqdm_notebook)


def _in_notebook() -> bool:
    """Whether this runs in a Jupyter kernel (tqdm.auto's test; IPython is not imported)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


def _is_terminal(file: Any) -> bool:
    try:
        return bool(file.isatty())
    except (AttributeError, ValueError):  # no isatty, or closed
        return False
