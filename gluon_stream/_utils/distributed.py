"""Which part of the data this process trains on: ``num_parts`` / ``part_index`` (MXNet's names).

``'auto'`` reads the rank and the world size from, in order: a ``kvstore`` passed in
(``kv.rank``, ``kv.num_workers``), Horovod (``horovod.mxnet`` when importable and
initialised), then the environment that ``horovodrun``/``mpirun``/``torchrun``-style
launchers set. Sources that disagree are an error, not a guess.
"""
from __future__ import annotations

import importlib
import logging
import os
from typing import Any, Mapping

from . import validate as _validate

__all__ = ["SYNC_KVSTORES", "resolve_parts", "synchronous_job"]

logger = logging.getLogger(__name__)

ENV_PAIRS = (  # (rank variable, size variable)
    ("HOROVOD_RANK", "HOROVOD_SIZE"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMI_RANK", "PMI_SIZE"),
    ("RANK", "WORLD_SIZE"),
)


#: kvstore types whose workers step together (a push waits for every worker's), as Horovod's do
SYNC_KVSTORES = ("dist_sync", "dist_sync_device", "dist_device_sync", "horovod")


def synchronous_job(kvstore: Any = None) -> str | None:
    """What makes this process's rank step together with the others, where it can be told:
    a synchronous kvstore's type (``'dist_sync'``, ...) or ``'horovod'`` (initialised, more
    than one rank); None otherwise (independent ranks, or a launcher that does not say)."""
    kind = getattr(kvstore, "type", None)
    if isinstance(kind, str) and kind in SYNC_KVSTORES:
        return kind
    hvd = _from_horovod()
    return "horovod" if hvd is not None and hvd[0] > 1 else None


def _from_horovod() -> tuple[int, int] | None:
    try:
        hvd = importlib.import_module("horovod.mxnet")
    except ImportError:
        return None
    try:
        return int(hvd.size()), int(hvd.rank())
    except ValueError:  # horovod raises ValueError before hvd.init()
        logger.debug("horovod.mxnet is importable but not initialised")
        return None


def _from_env(environ: Mapping[str, str]) -> dict[str, tuple[int, int]]:
    found = {}
    for rank_var, size_var in ENV_PAIRS:
        if rank_var in environ and size_var in environ:
            try:
                found[f"{rank_var}/{size_var}"] = (int(environ[size_var]), int(environ[rank_var]))
            except ValueError as exc:
                raise ValueError(f"{rank_var}={environ[rank_var]!r} / {size_var}="
                                 f"{environ[size_var]!r} are not integers") from exc
    return found


def resolve_parts(num_parts: int | str = 1, part_index: int | str = 0, *, kvstore: Any = None,
                  environ: Mapping[str, str] | None = None) -> tuple[int, int]:
    """Return ``(num_parts, part_index)``, resolving ``'auto'`` from kvstore, Horovod or env.

    Raises:
        ValueError: out of range, only one of the two is 'auto', or the sources disagree.
    """
    if (num_parts == "auto") != (part_index == "auto"):
        raise ValueError("num_parts and part_index must both be 'auto' or both integers, got "
                         f"num_parts={num_parts!r}, part_index={part_index!r}")
    if num_parts == "auto":
        found: dict[str, tuple[int, int]] = {}
        if kvstore is not None:
            found["kvstore"] = (int(kvstore.num_workers), int(kvstore.rank))
        hvd = _from_horovod()
        if hvd is not None:
            found["horovod"] = hvd
        found.update(_from_env(os.environ if environ is None else environ))
        if not found:
            raise ValueError(
                "num_parts='auto' found no rank: pass kvstore=mx.kv.create('dist_sync'), call "
                "hvd.init() first, or launch with horovodrun/mpirun (or set RANK and WORLD_SIZE)")
        if len(set(found.values())) > 1:
            raise ValueError(f"num_parts='auto': rank sources disagree (as (size, rank)): {found}")
        num_parts, part_index = next(iter(found.values()))
        logger.info("num_parts=%d, part_index=%d (from %s)", num_parts, part_index,
                    ", ".join(found))
    num_parts = _validate.integer("num_parts", num_parts, minimum=1, hint="or 'auto'")
    part_index = _validate.integer("part_index", part_index, minimum=0, hint="or 'auto'")
    if part_index >= num_parts:
        raise ValueError(f"part_index must be in [0, {num_parts}), got {part_index!r}")
    return num_parts, part_index
