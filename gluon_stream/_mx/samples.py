"""Samples for per-sample code (``sample_transform``, ``batchify_fn``): rows of a shard's arrays.

``sample_format`` decides what the code receives:

* ``'numpy'``: what ``gluon.data.ArrayDataset`` over numpy arrays gives: ``a[i]`` per array
  (a numpy scalar for 1-D arrays); no per-sample NDArray is made (about 0.2 ms each here).
* ``'ndarray'``: what Gluon's vision datasets and ``ArrayDataset(nd.array(x), y)`` give, the
  input Gluon's and GluonCV's transforms are written for: an NDArray per field with a
  per-sample shape, a numpy scalar for scalar fields (labels).
* ``'auto'`` (default): numpy rows, unless MXNet or GluonCV code rejects them (raises a
  TypeError, ValueError or AttributeError from inside ``mxnet``/``gluoncv``, as
  ``ToTensor()`` or GluonCV's ``RandomCrop`` do for a numpy image); that batch is then made
  again with NDArray rows, and every later one too (logged once at INFO).

A single-array shard gives samples that are the row itself, several arrays a tuple, and the
transform is applied as ``Dataset.transform`` does: ``fn(*sample)`` for a tuple.

A batch made with a ``seed`` is made with the global RNGs seeded from it
(:func:`seeded_globals`; why, in :mod:`.workers`). In a worker process MXNet's RNG is seeded
lazily (:func:`seed_mxnet_lazily`): just before the batch's first MXNet operator, so numpy-only
per-sample code does not pay MXNet's 1.7 ms reseed per batch.
"""
from __future__ import annotations

import contextlib
import logging
import random
from typing import Any, Callable, Iterator, Literal, Mapping, Sequence

import numpy as np

from .._utils import validate as _validate
from ..errors import add_note
from . import as_legacy_batch, as_numpy_batch, import_mxnet, mode_scope, numpy_mode
from .shm import stack_batchify

__all__ = ["SAMPLE_FORMATS", "BatchMaker", "Refs", "SampleFormat", "seed_mxnet_lazily",
           "seeded_globals"]

logger = logging.getLogger(__name__)

SAMPLE_FORMATS = ("auto", "numpy", "ndarray")
SampleFormat = Literal["auto", "numpy", "ndarray"]
_REJECTING_PACKAGES = ("mxnet", "gluoncv")

#: A batch's samples: ``[(source id, rows), ...]``, rows a ``range`` or an index array.
Refs = Sequence[tuple[int, Any]]


class BatchMaker:
    """Builds one batch from sample references: rows, ``sample_transform``, ``batchify_fn``.

    Args:
        sample_transform: ``fn(*sample) -> sample``, or None.
        batchify_fn: Joins the samples of a batch; None: Gluon's default (in a worker, its
            equivalent that stacks straight into the shared memory the batch goes back in:
            :func:`~gluon_stream._mx.shm.stack_batchify`).
        sample_format: ``'auto'``, ``'numpy'`` or ``'ndarray'`` (see the module doc).
        in_worker: Batches are made in a worker process: Gluon's shared-memory batchify is the
            default, and a batch's seed seeds MXNet's RNG too. Otherwise (the training
            process) numpy's and ``random``'s states are restored after each seeded batch.
    """

    def __init__(self, sample_transform: Callable[..., Any] | None,
                 batchify_fn: Callable[[list], Any] | None, sample_format: str,
                 in_worker: bool = False) -> None:
        _validate.choice("sample_format", sample_format, SAMPLE_FORMATS)
        self.sample_transform = sample_transform
        default = (stack_batchify if in_worker
                   else import_mxnet().gluon.data.dataloader.default_batchify_fn)
        self.batchify_fn = batchify_fn or default
        self.sample_format = sample_format
        self.in_worker = in_worker
        self._format = "numpy" if sample_format == "auto" else sample_format

    @property
    def format(self) -> str:
        """The row format in use now (``'auto'`` starts as numpy)."""
        return self._format

    def __call__(self, sources: Mapping[int, Sequence[np.ndarray]], refs: Refs,
                 seed: int | None = None, numpy: bool | None = None) -> Any:
        """The batch of ``refs``; with a ``seed``, made with the global RNGs seeded from it.

        ``numpy``: the loop's thread had Gluon's numpy semantics on (``npx.set_np()``), so the
        batch is made with them on here too (NDArray rows are ``mx.np.ndarray``, Gluon's
        default batchify stacks into those); None: this thread's own mode. What comes back
        holds legacy NDArray views (no copy), as every stage after this one expects.
        """
        with mode_scope(numpy):
            return as_legacy_batch(self._either(sources, refs, seed))

    def _either(self, sources: Mapping[int, Sequence[np.ndarray]], refs: Refs,
                seed: int | None) -> Any:
        if self.sample_format != "auto" or self._format == "ndarray":
            return self._make(sources, refs, self._format, seed)
        try:
            return self._make(sources, refs, "numpy", seed)
        except (AttributeError, TypeError, ValueError) as exc:
            if not _raised_inside(exc, _REJECTING_PACKAGES):
                raise
            try:  # seeded afresh: the remade batch draws the numbers the first attempt drew
                batch = self._make(sources, refs, "ndarray", seed)
            except Exception as again:
                add_note(exc, f"gluon_stream: sample_format='auto' gave numpy rows, which MXNet "
                              f"code rejected; NDArray rows failed too ({type(again).__name__}: "
                              f"{again})")
                raise exc from None
            self._format = "ndarray"
            logger.info("sample_format='auto': MXNet code rejected numpy rows (%s: %s); "
                        "per-sample code gets NDArrays from now on (pass sample_format="
                        "'ndarray' to start so)", type(exc).__name__, exc)
            return batch

    def _make(self, sources: Mapping[int, Sequence[np.ndarray]], refs: Refs, fmt: str,
              seed: int | None) -> Any:
        nd = import_mxnet().nd if fmt == "ndarray" else None
        with seeded_globals(seed, in_worker=self.in_worker):
            samples = [_sample(sources[sid], i, nd) for sid, rows in refs for i in rows]
            numpy = numpy_mode()
            if nd is not None and numpy:
                samples = [as_numpy_batch(s) for s in samples]  # views of the rows made
            fn = self.sample_transform
            if fn is not None:
                samples = [fn(*s) if isinstance(s, tuple) else fn(s) for s in samples]
            if numpy and self.batchify_fn is stack_batchify:  # it stacks with legacy operators
                samples = as_legacy_batch(samples)
            return self.batchify_fn(samples)


@contextlib.contextmanager
def seeded_globals(seed: int | None, in_worker: bool) -> Iterator[None]:
    """Seed numpy's global RNG and ``random`` from ``seed`` for the block (nothing if None).

    In a worker process (``in_worker``) MXNet's CPU RNG is seeded too, and nothing is put
    back: the worker's RNGs are its batches' alone. In the training process numpy's and
    ``random``'s states are saved and restored around the block, so the loop's own draws do
    not depend on the loader; MXNet's RNG is not touched there, since MXNet cannot save and
    restore its state (the loop's ``mx.random`` draws would change). Only the CPU RNG is
    seeded: seeding a GPU's in a forked worker would use CUDA after fork.
    """
    if seed is None:
        yield
        return
    saved = None if in_worker else (np.random.get_state(), random.getstate())
    np.random.seed(seed & 0xFFFFFFFF)
    random.seed(seed)
    if in_worker:
        if _LAZY[0]:
            _LAZY[1] = seed & 0x7FFFFFFF  # taken by the batch's first MXNet operator, if any
        else:
            mx = import_mxnet()
            mx.random.seed(seed & 0x7FFFFFFF, ctx=mx.cpu())
    try:
        yield
    finally:
        if saved is not None:
            np.random.set_state(saved[0])
            random.setstate(saved[1])
        if in_worker:
            _LAZY[1] = None


_LAZY: list = [False, None]  # [installed in this process, the seed MXNet's RNG takes next]


def _take_seed() -> None:
    seed, _LAZY[1] = _LAZY[1], None
    mx = import_mxnet()
    mx.random.seed(seed, ctx=mx.cpu())


def _seeding_first(call: Callable[..., Any]) -> Callable[..., Any]:
    def call_after_seeding(*args: Any, **kwargs: Any) -> Any:
        if _LAZY[1] is not None:
            _take_seed()
        return call(*args, **kwargs)
    call_after_seeding.__wrapped__ = call  # type: ignore[attr-defined]
    return call_after_seeding


def seed_mxnet_lazily() -> bool:
    """In a worker process: let a batch's seed reach MXNet's CPU RNG just before the batch's
    first MXNet operator runs, instead of when the batch starts; whether it could.

    Reseeding MXNet's CPU RNG costs about 1.7 ms (it reseeds 1024 parallel generators), about a
    fifth of a batch of 64 CIFAR images augmented in numpy, which never draw from it. Every
    way Python runs MXNet operators is wrapped (imperative operators, which ``nd``, ``np``,
    ``npx`` and non-hybridized blocks call; hybridized blocks' cached graphs; symbolic
    executors), so a batch that draws from MXNet's RNG draws exactly what an eager seed gives.
    A build whose cached graphs are compiled (Cython) cannot be wrapped: it is seeded eagerly.
    """
    if _LAZY[0]:
        return True
    import_mxnet()
    from mxnet import executor
    from mxnet.ndarray import _internal, register

    cached_op = _internal.CachedOp
    try:
        cached_op.__call__ = _seeding_first(cached_op.__call__)
    except (AttributeError, TypeError):  # a compiled (Cython) class
        logger.debug("MXNet's CachedOp cannot be wrapped: MXNet's RNG is seeded per batch")
        return False
    register._imperative_invoke = _seeding_first(register._imperative_invoke)
    executor.Executor.forward = _seeding_first(executor.Executor.forward)
    _LAZY[0] = True
    return True


def _sample(arrays: Sequence[np.ndarray], i: int, nd: Any) -> Any:
    """Row ``i`` of each array: numpy (``nd`` None) or NDArray for fields with a shape."""
    fields = [a[i] for a in arrays]
    if nd is not None:
        fields = [nd.array(f, dtype=f.dtype) if getattr(f, "ndim", 0) else f for f in fields]
    return fields[0] if len(fields) == 1 else tuple(fields)


def _raised_inside(exc: BaseException, packages: tuple[str, ...]) -> bool:
    """Whether the innermost frame of ``exc``'s traceback is code of one of ``packages``."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    module = tb.tb_frame.f_globals.get("__name__", "")
    return module.split(".")[0] in packages
