"""The shard sizes ``gluon-stream generate`` records in a cache directory it filled ahead.

One JSON file, :data:`SIZES_FILE`, in the cache directory: ``{"version": 1, "shards": {name:
{"samples": n, "recipe": digest}}}``. It is written whole to a temp file and renamed into place,
so a reader sees the record before or after a write, never a part of one. A record that cannot
be read counts as none (one WARNING): the sizes are then unknown until the shards are produced.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any, Mapping

from .._utils import validate as _validate
from .._utils.files import replace_with_json

__all__ = ["SIZES_FILE", "add_sizes", "read_sizes"]

logger = logging.getLogger(__name__)

SIZES_FILE = ".gluon_stream-sizes.json"  # sizes recorded by gluon-stream generate


def read_sizes(root: str) -> dict[str, dict]:
    """Shard name -> ``{"samples": n, "recipe": digest}`` recorded in the directory ``root``
    (empty if nothing was recorded, or the record is unreadable)."""
    path = os.path.join(root, SIZES_FILE)
    try:
        with open(path, encoding="utf-8") as fp:
            data = json.load(fp)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:  # the sizes then count as unknown
        logger.warning("cannot read %s (%s): shard sizes are unknown until produced", path, exc)
        return {}
    shards = data.get("shards") if isinstance(data, dict) else None
    if not isinstance(shards, dict):
        logger.warning("%s holds no shard sizes; ignoring it", path)
        return {}
    return {name: entry for name, entry in shards.items() if isinstance(entry, dict)
            and _validate.is_int(entry.get("samples")) and entry["samples"] >= 0}


def add_sizes(root: str, sizes: Mapping[str, Mapping[str, Any]], tmp: str) -> None:
    """Add ``sizes`` (as :func:`read_sizes` gives them) to the record in ``root``, written to
    the temp path ``tmp`` (removed either way) and renamed into place."""
    merged = {**read_sizes(root), **sizes}
    replace_with_json(os.path.join(root, SIZES_FILE), {"version": 1, "shards": merged}, tmp)
