"""MixSource: several sources in chosen proportions, as one source.

Every epoch takes ``shards_per_epoch`` shards, the same number of each source every epoch:

* **Counts** follow the weights by largest remainder (Hamilton's method): each source gets the
  whole part of its quota ``shards_per_epoch * weight / sum of weights``, and the shards left
  over go to the largest fractional parts, ties to the first name in sorted order. Every source
  must get at least one shard (a source a mix never reads is a mistake, not a proportion).
* **Keys**: a source taking ``c`` shards per epoch takes, in epoch ``e``, positions
  ``e*c .. (e+1)*c - 1`` of its endless key sequence: its keys (those of epoch ``e`` when they
  are a callable ``keys(epoch)``) in a shuffle drawn from ``(seed, name, pass 0)``, then all of
  them again in a shuffle drawn from ``(seed, name, pass 1)``, and so on. A source with fewer
  keys than ``c`` cycles through them, each pass in a fresh order; a larger one continues where
  the previous epoch stopped, and every key is read once before any is read again. An epoch's
  keys are a pure function of ``(seed, epoch)``: no memory of earlier epochs, so ranks agree and
  a resumed loader (its state holds a digest of the epoch's keys) finds the same keys.
* **Order**: stride scheduling. The ``j``-th of a source's ``c`` shards in the epoch sits at
  ``(j + u) / c`` on ``[0, 1)``, where the phase ``u`` of each source is drawn from
  ``(seed, epoch)``; the epoch's shards are sorted by that place. Each source is spread evenly
  over the epoch, in an order that changes every epoch: any first ``n`` shards hold a source's
  share of ``n`` to within one shard with two sources, within two with three (with ``k``
  sources, ``1 + (k - 2) * share``). So a loop that reads shards in order (``shuffle=False``)
  never trains on a long run of one source, as a seeded shuffle of the epoch's shards would
  let it; ``shuffle=True`` on the loader shuffles the mixed keys again anyway.

Keys of the mix are ``(name, key)`` pairs, so keys equal in two sources stay apart, and a
caching source's shards are cached under its name (:meth:`CachingSource.set_namespace`): two
sources may share one ``cache_dir`` even with equal keys.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import numbers
import warnings
from fractions import Fraction
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from .._utils import validate as _validate
from .._utils.random import key_hash, seeded_rng
from ..errors import UnsafeKey, add_note
from .base import NAMESPACE_SEPARATOR, CachingSource, RawShard, Source, validate_key

__all__ = ["MixSource", "cycled", "interleave", "largest_remainder"]

logger = logging.getLogger(__name__)

_ORDER = 0x313C0  # seeded_rng purpose: the epoch's interleave
_PASS = 0x313C1  # seeded_rng purpose: a source's pass over its keys


def largest_remainder(weights: Mapping[str, Fraction], total: int) -> dict[str, int]:
    """Split ``total`` seats by ``weights`` with Hamilton's method: the whole part of each quota
    ``total * weight / sum``, then one more seat for each of the largest fractional parts (ties
    to the first name in sorted order). Exact arithmetic: pass Fractions or ints.

    Example:
        >>> largest_remainder({"a": 3, "b": 1}, 10)
        {'a': 8, 'b': 2}
    """
    whole = sum(weights.values())
    quotas = {name: Fraction(total) * w / whole for name, w in weights.items()}
    counts = {name: math.floor(q) for name, q in quotas.items()}
    left = total - sum(counts.values())
    for name in sorted(quotas, key=lambda n: (counts[n] - quotas[n], n))[:left]:
        counts[name] += 1
    return counts


def interleave(counts: Mapping[str, int], rng: np.random.Generator) -> list[str]:
    """One name per shard, ``counts[name]`` times each, spread evenly (stride scheduling): the
    ``j``-th of ``c`` sits at ``(j + u) / c`` with a phase ``u`` drawn from ``rng`` per name
    (in sorted name order); sorted by place, ties to the first name.

    Example:
        >>> interleave({"a": 3, "b": 1}, np.random.default_rng(0))
        ['a', 'b', 'a', 'a']
    """
    names = sorted(counts)
    phases = rng.random(len(names))
    places = sorted(((j + u) / counts[name], i)
                    for i, (name, u) in enumerate(zip(names, phases))
                    for j in range(counts[name]))
    return [names[i] for _, i in places]


def cycled(keys: Sequence[Any], start: int, count: int,
           order: Callable[[int], np.ndarray]) -> list[Any]:
    """Positions ``start .. start + count - 1`` of the endless sequence that reads ``keys``
    in pass after pass, pass ``p`` in the order ``order(p)`` (a permutation of their indices).

    Example:
        >>> cycled("abc", 2, 4, lambda p: np.arange(3)[::-1] if p % 2 else np.arange(3))
        ['c', 'c', 'b', 'a']
    """
    n = len(keys)
    out: list[Any] = []
    pos = start
    while len(out) < count:
        p, i = divmod(pos, n)
        take = min(count - len(out), n - i)
        out.extend(keys[j] for j in order(p)[i:i + take])
        pos += take
    return out


class MixSource(Source):
    """Shards of several sources in chosen proportions: each epoch takes ``shards_per_epoch``
    shards, as many of each source every epoch as its weight asks (largest remainder), spread
    evenly over the epoch in an order drawn from ``(seed, epoch)``.

    A source with fewer keys than its share cycles through them, each pass in a fresh shuffle;
    a larger one continues where the previous epoch stopped (the rules in full:
    :mod:`gluon_stream.sources.mix`). The mix's keys are ``(name, key)`` pairs; a shard is made
    by its own source, with that source's epoch semantics (a ``{epoch}`` command stays per
    epoch). Caching sources are given their name as cache namespace
    (:meth:`~gluon_stream.sources.CachingSource.set_namespace`), so sources may share one
    ``cache_dir`` even with equal keys; shards cached by a source used alone, under its bare
    keys, are made again once. ``loader.stats.per_source()`` counts the samples of each source
    the loop received, and ``summary()`` shows a line per source of what was produced. Closing the
    mix closes its sources.

    Args:
        sources: ``{name: source}``; names are 1-200 letters, digits or ``_.:=@,-`` (no
            ``+``), they tag the keys, the stats and the cache names. Each source's keys must
            be a list, or a callable ``keys(epoch)`` returning one (an endless iterator cannot
            be cycled), and hold at least one key.
        weights: ``{name: weight}`` for every source, each a finite number above 0 (only
            ratios count); None: equal weights. A float counts as the decimal written: the
            shortest one that gives it back in its own precision (``0.7`` and
            ``np.float32(0.7)`` are both 7/10).
        shards_per_epoch: Shards per epoch, of all sources together: at least enough that every
            source gets one. Counts are exact when it is a multiple of the sum of the weights
            (as integers); otherwise a warning names the counts taken every epoch.
        seed: Decides which keys each epoch takes and their order, the same on every rank;
            None: 0 (logged at INFO). The loader's ``seed`` shuffles again with
            ``shuffle=True``, and deals the mixed keys to ``num_parts``.

    Raises:
        TypeError: A source that is not a Source (or is a MixSource), or keys that are an
            endless iterator.
        ValueError: An empty ``sources``, weights for unknown or missing names, a weight that
            is not a finite number above 0, a ``shards_per_epoch`` that leaves a source without
            a shard, a source with no keys.

    Example:
        >>> from numpy import full
        >>> from gluon_stream import FunctionSource
        >>> old = FunctionSource(range(100), lambda k: full(4, k))
        >>> new = FunctionSource(["a", "b"], lambda k: full(4, ord(k)))
        >>> mix = MixSource({"old": old, "new": new}, weights={"old": 1, "new": 3},
        ...                 shards_per_epoch=4, seed=0)
        >>> mix.counts
        {'old': 1, 'new': 3}
        >>> mix.keys_for_epoch(0)[0]
        [('new', 'a'), ('new', 'b'), ('old', 95), ('new', 'b')]
        >>> mix.produce(("new", "a"), epoch=0).source
        'new'
    """

    def __init__(self, sources: Mapping[str, Source], *,
                 weights: Mapping[str, float] | None = None, shards_per_epoch: int,
                 seed: int | None = None) -> None:
        super().__init__(())  # keys come from the sources: keys_for_epoch is overridden
        self.sources: dict[str, Source] = _checked_sources(sources)
        exact = _checked_weights(weights, self.sources)
        self.weights: dict[str, Any] = {name: (1 if weights is None else weights[name])
                                        for name in self.sources}
        self.shards_per_epoch = _validate.integer("shards_per_epoch", shards_per_epoch,
                                                  minimum=1)
        if seed is None:
            logger.info("MixSource: no seed given: using seed=0 (which keys each epoch takes, "
                        "and their order)")
            seed = 0
        self.seed = _validate.integer("seed", seed)
        self.counts: dict[str, int] = largest_remainder(exact, self.shards_per_epoch)
        _check_counts(exact, self.counts, self.shards_per_epoch)
        for name in self.sources:
            self._source_keys(name, 0)  # refuses endless or empty keys now, not mid-training
        for name, source in self.sources.items():
            if isinstance(source, CachingSource):
                source.set_namespace(name)
        logger.info("MixSource: %s shards per epoch (%d in all)",
                    ", ".join(f"{n} {c}" for n, c in self.counts.items()), self.shards_per_epoch)

    def __repr__(self) -> str:
        return (f"MixSource({', '.join(f'{n}={type(s).__name__}' for n, s in self.sources.items())}"
                f"; counts={self.counts}, seed={self.seed})")

    # -- keys --------------------------------------------------------------------------------
    @property
    def same_keys(self) -> bool:
        """False: every epoch takes its own keys from the sources."""
        return False

    def keys_for_epoch(self, epoch: int) -> tuple[list[tuple[str, Any]], bool]:
        """The epoch's ``(name, key)`` pairs, in the mixed order, and True (always finite).

        Raises:
            TypeError: A source's keys for ``epoch`` are an endless iterator.
            ValueError: A source has no keys for ``epoch``.
        """
        epoch = _validate.integer("epoch", epoch, minimum=0)
        taken = {name: iter(self._source_keys(name, epoch)) for name in self.sources}
        order = interleave(self.counts, seeded_rng(self.seed, epoch, _ORDER))
        return [(name, next(taken[name])) for name in order], True

    def _source_keys(self, name: str, epoch: int) -> list[Any]:
        """Source ``name``'s keys in ``epoch``: its share at ``epoch * count`` of its sequence."""
        keys, finite = self.sources[name].keys_for_epoch(epoch)
        if not finite:
            raise TypeError(
                f"MixSource: the keys of source {name!r} are an endless iterator; a mix cycles "
                "through each source's keys and finds epoch e's at a fixed position, so it needs "
                "a list, or a callable keys(epoch) that returns a list")
        keys = list(keys)
        if not keys:
            raise ValueError(f"MixSource: source {name!r} has no keys for epoch {epoch}; every "
                             "source of a mix needs at least one")
        count = self.counts[name]
        passes: dict[int, np.ndarray] = {}

        def order(p: int) -> np.ndarray:
            if p not in passes:
                passes[p] = seeded_rng(self.seed, _PASS, key_hash(name), p).permutation(len(keys))
            return passes[p]

        return cycled(keys, epoch * count, count, order)

    # -- shards ------------------------------------------------------------------------------
    def _split(self, key: Any) -> tuple[str, Source, Any]:
        if not (isinstance(key, tuple) and len(key) == 2 and key[0] in self.sources):
            raise UnsafeKey(f"MixSource: key {key!r} is not a (source name, key) pair of this "
                            f"mix (sources: {', '.join(map(repr, self.sources))})")
        return key[0], self.sources[key[0]], key[1]

    @property
    def per_epoch(self) -> bool:
        """True if any source makes a key's shard anew each epoch (a ``{epoch}`` command)."""
        return any(source.per_epoch for source in self.sources.values())

    @property
    def cached(self) -> bool:
        """Whether any source keeps its shards in a ``cache_dir`` (they can be generated ahead)."""
        return any(getattr(source, "cached", False) for source in self.sources.values())

    @property
    def generates_apart(self) -> bool:
        """Whether every source that generates ahead into a cache does it in another program."""
        return self.cached and all(source.generates_apart for source in self.sources.values()
                                   if source.cached)

    @property
    def cache_room(self) -> int | None:
        """The smallest count bound of the sources' caches (None: none has one)."""
        rooms = [room for room in (s.cache_room for s in self.sources.values()) if room is not None]
        return min(rooms) if rooms else None

    def produce(self, key: Any, epoch: int, executor: Any = None) -> RawShard:
        """The shard of ``key = (name, inner key)``, made by source ``name`` for ``epoch``; its
        ``source`` is ``name``, and an error it raises carries a note naming the source."""
        self._check_open()
        name, source, inner = self._split(key)
        try:
            raw = source.produce(inner, epoch, executor=executor)
        except Exception as exc:
            add_note(exc, f"gluon_stream: shard {inner!r} of source {name!r} of a MixSource")
            raise
        return dataclasses.replace(raw, key=key, source=name)

    def ensure_file(self, key: Any, epoch: int) -> tuple[str | None, bool, float]:
        """Make sure a caching source's shard is in its cache: ``(path, cache_hit, seconds)``
        (see :meth:`CachingSource.ensure_file`); a source without a cache makes nothing ahead:
        ``(None, True, 0.0)``."""
        self._check_open()
        _, source, inner = self._split(key)
        if isinstance(source, CachingSource) and source.cached:
            return source.ensure_file(inner, epoch)
        return None, True, 0.0

    @property
    def agrees_on_failures(self) -> bool:
        """Whether every source sees the same failures in every process (see
        :attr:`CachingSource.agrees_on_failures`)."""
        return all(source.agrees_on_failures for source in self.sources.values())

    def retry_failures(self, keys: Iterable[Any] | None = None, epoch: int = 0) -> list[str]:
        """Forget the recorded failures of ``keys`` (``(name, inner key)``; None: all of every
        source's): see :meth:`CachingSource.retry_failures`."""
        if keys is None:
            return [name for source in self.sources.values()
                    for name in source.retry_failures(None, epoch)]
        dropped = []
        for key in keys:
            _, source, inner = self._split(key)
            dropped += source.retry_failures([inner], epoch)
        return dropped

    def num_samples(self, key: Any, epoch: int) -> int | None:
        _, source, inner = self._split(key)
        return source.num_samples(inner, epoch)

    def raw_bytes(self, key: Any, epoch: int) -> tuple[int, bool, float] | None:
        """What the key's own source tells of its raw arrays' bytes before they are read."""
        _, source, inner = self._split(key)
        return source.raw_bytes(inner, epoch)

    def known_size(self, key: Any, epoch: int) -> int | None:
        """The size the key's own source knows ahead (file headers, a cache filled ahead)."""
        _, source, inner = self._split(key)
        return source.known_size(inner, epoch)

    def unknown_size_reason(self) -> str:
        return "; ".join(f"source {name!r}: {source.unknown_size_reason()}"
                         for name, source in self.sources.items())

    def close(self) -> None:
        """Close every source (kills their running generators); idempotent."""
        super().close()
        with contextlib.ExitStack() as stack:  # closes all, raises the first failure after
            for source in self.sources.values():
                stack.callback(source.close)


def _checked_sources(sources: Any) -> dict[str, Source]:
    if not isinstance(sources, Mapping):
        raise TypeError(f"sources must be a dict {{name: source}}, got {type(sources).__name__}")
    if not sources:
        raise ValueError("sources is empty: a MixSource needs at least one {name: source}")
    seen: dict[int, str] = {}
    for name, source in sources.items():
        if not isinstance(name, str):
            raise TypeError(f"sources: names must be str, got {name!r} "
                            f"({type(name).__name__})")
        if NAMESPACE_SEPARATOR in name:
            raise ValueError(f"sources: name {name!r} contains {NAMESPACE_SEPARATOR!r}, which "
                             "separates a source's name from its keys in cache file names")
        try:
            validate_key(name)
        except UnsafeKey as exc:
            raise ValueError(f"sources: name {name!r} cannot name cache files: use 1-200 "
                             "letters, digits or '_.:=@,-', not starting with '-' or '.'") from exc
        if isinstance(source, MixSource):
            raise TypeError(f"sources: {name!r} is a MixSource; give its sources to this mix "
                            "directly, with their weights multiplied by its share")
        if not isinstance(source, Source):
            raise TypeError(f"sources: {name!r} must be a Source (CommandSource, "
                            f"FunctionSource, FileSource, ...), got {type(source).__name__}")
        other = seen.setdefault(id(source), name)
        if other != name:
            raise ValueError(f"sources: {other!r} and {name!r} are the same source object; "
                             "give each name a source of its own (or one name a larger weight)")
    return dict(sources)


def _checked_weights(weights: Any, sources: Mapping[str, Source]) -> dict[str, Fraction]:
    """Each source's weight as an exact Fraction (a float as the decimal it prints as)."""
    if weights is None:
        logger.info("MixSource: no weights given: every source weighs the same")
        return {name: Fraction(1) for name in sources}
    if not isinstance(weights, Mapping):
        raise TypeError(f"weights must be a dict {{name: weight}}, got {type(weights).__name__}")
    unknown = [name for name in weights if name not in sources]
    if unknown:
        raise ValueError(f"weights name {unknown} that are not sources; sources: "
                         f"{list(sources)}")
    missing = [name for name in sources if name not in weights]
    if missing:
        raise ValueError(f"weights give no weight for {missing}: give every source a weight, "
                         "or weights=None for equal weights")
    return {name: _weight(name, weights[name]) for name in sources}


def _weight(name: str, value: Any) -> Fraction:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"weights[{name!r}] must be a number above 0, got {value!r}")
    if isinstance(value, numbers.Rational):
        exact = Fraction(int(value.numerator), int(value.denominator))
    elif math.isfinite(float(value)):
        exact = _as_written(value)
    else:
        raise ValueError(f"weights[{name!r}] must be a finite number above 0, got {value!r}")
    if exact <= 0:
        raise ValueError(f"weights[{name!r}] must be a number above 0, got {value!r}; leave a "
                         "source out of the mix rather than weigh it 0")
    return exact


def _as_written(value: Any) -> Fraction:
    """A float as the decimal it was written as: the shortest decimal that gives the same
    number back in the float's own precision (Python's ``repr`` for a float, numpy's for its
    float32 or float16). So ``0.7`` and ``np.float32(0.7)`` are both 7/10, not the binary value
    each stores (float32's 0.699999988079071...)."""
    if isinstance(value, np.floating):
        return Fraction(np.format_float_positional(value, unique=True, trim="-"))
    return Fraction(repr(float(value)))


def _check_counts(weights: Mapping[str, Fraction], counts: Mapping[str, int], total: int) -> None:
    """Refuse a source left without shards; warn where counts differ from the quotas."""
    empty = [name for name, count in counts.items() if count == 0]
    if empty:
        raise ValueError(
            f"shards_per_epoch={total} leaves source {empty[0]!r} without a shard per epoch "
            f"(its weight asks for {_quota(weights, empty[0], total):.3g}); every source needs "
            f"one: pass shards_per_epoch={_enough(weights, total)} or more, or raise its weight")
    share = sum(weights.values())
    step = math.lcm(*((w / share).denominator for w in weights.values()))
    if total % step:
        warnings.warn(
            f"MixSource: shards_per_epoch={total} takes "
            f"{', '.join(f'{n} {c}' for n, c in counts.items())} shards every epoch where the "
            f"weights ask for {', '.join(f'{_quota(weights, n, total):.3g}' for n in counts)}: "
            f"pass a multiple of {step} for exact proportions", stacklevel=3)


def _quota(weights: Mapping[str, Fraction], name: str, total: int) -> float:
    return float(total * weights[name] / sum(weights.values()))


def _enough(weights: Mapping[str, Fraction], total: int) -> int:
    """The smallest shards_per_epoch from ``total`` up that gives every source a shard."""
    share = sum(weights.values())
    bound = math.ceil(share / min(weights.values()))  # every quota >= 1 from here on
    for m in range(total + 1, min(bound, total + 10_000)):
        if all(largest_remainder(weights, m).values()):
            return m
    return bound
