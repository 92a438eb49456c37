"""Shard sources: turn shard keys into arrays, generating shard files on demand.

* :class:`CommandSource` runs an external program per key (argv only, never a shell).
* :class:`FunctionSource` calls a Python function per key.
* :class:`FileSource` reads existing ``.npy`` / ``.npz`` files.
* :class:`MixSource` takes the shards of several sources in chosen proportions.

Keys are a sequence, an (endless) iterator, or a callable ``keys(epoch)`` that returns
that epoch's keys (see :mod:`gluon_stream.sources.base`).
"""
from .base import CachingSource, RawShard, Source
from .command import CommandSource
from .files import FileSource
from .function import FunctionSource
from .mix import MixSource

__all__ = ["CachingSource", "CommandSource", "FileSource", "FunctionSource", "MixSource",
           "RawShard", "Source"]
