"""A pure-Python model of what StreamLoader promises: which samples form which batches.

Nothing here imports gluon_stream or MXNet. The model states the promise from its definition,
not from the loader's code, so that a test can drive the real loader through any combination
of features and interruptions and compare the batches exactly:

* **Order.** An epoch's shard order, each shard's row order and the mixing of a shuffle window
  are drawn from ``(seed, epoch, purpose)`` by the recipe below (:func:`_rng`), the same on
  every machine, so a resumed run, another worker setting or another host agree.
* **Units.** Without a window an epoch is its shards in order; with ``shuffle_window=k`` it is
  ``shards + k - 1`` units, unit ``t`` holding the ``(t - j)``-th of ``k`` slices of each shard
  ``j`` in ``t - k + 1 .. t``, shuffled together. A skipped shard (``on_error='skip'``) is an
  empty shard.
* **Batches.** The units' samples, read in order, are cut into batches of ``batch_size``:
  nothing lost or duplicated at unit boundaries. The epoch's short tail is yielded
  (``'keep'``), dropped (``'discard'``) or opens the next epoch (``'rollover'``).
* **Ranks.** ``num_parts`` deal each epoch's shards to the parts (``deal='shards'``), or every
  part takes its stride of every shard's rows (``deal='samples'``).
* **even_batches.** Every part yields only full batches, and (shards dealt, sizes declared)
  the smallest part's count of them: a part that skipped shards repeats its last batch.
  ``even_batches='pad'`` instead keeps every sample: every part yields the largest part's count
  of batches, all of ``batch_size`` rows; a short last batch is padded with its own rows
  repeated, then the last batch is repeated as padding; ``pad`` counts the padding rows.
  Without sizes, parts take strides of every shard whole (``deal='strides'``); with
  ``even_batches=True`` the strides go on from where the last shard's stopped
  (``deal='balanced'``: row ``i`` of a shard with ``r`` rows before it in the epoch goes to
  part ``(r + i) % parts``), and every part yields the smallest part's full batches.
* **samples_per_epoch=N.** A part's samples form one stream: the key list's pass 0 (shuffled
  from ``(seed, 0)``), then pass 1 (from ``(seed, 1)``), ... Epoch ``e`` reads samples
  ``e*N .. (e+1)*N - 1`` of it, batched as an epoch is (``'rollover'`` carries the tail into
  the next epoch's first batch; even_batches keeps full batches, or pads the last one). An
  endless key iterator is one pass that never ends: part ``p`` takes keys ``p, p + parts, ...``.
* **Keys.** A list (every epoch the same keys), a callable ``keys(epoch)`` or a MixSource (the
  epoch's key list; the test takes a mix's from the mix itself, whose own rules are tested
  apart), or an endless iterator (with ``samples_per_epoch``).
* **Context** (``context_rows=C``, a key list). A shard's transform sees the last ``C`` raw
  rows of the keys before it, in the key list's order, then its own: the keys' rows form one
  long series. The test's transform makes one sample of every raw row with ``C`` rows before it
  in the series, naming it and the row ``C`` back (:func:`with_context`): every rule above then
  holds of those samples (the shards' sizes are their counts).
* **Loss with even_batches=True.** An epoch leaves out at most
  ``parts * (batch_size - 1) + parts - 1`` samples (:func:`loss_bound`), sizes known or not:
  whole shards are dealt only where the worst deal of them keeps within it (every epoch the
  same keys and sizes, known ahead), else balanced strides (``on_error='skip'`` keeps whole
  shards: a shard failing on one rank alone must not shift that rank's strides).
* **Topologies the ranks must agree on** (:func:`deal_for`). Fewer keys than ranks:
  ``samples_per_epoch`` and ``even_batches=True`` deal strides of every shard instead of whole
  shards (a rank dealt no key would read nothing); with ``samples_per_epoch`` they turn: the
  shard at position ``j`` of pass ``p`` gives its first row to part ``(p + j) % parts``
  (``deal='turns'``), so shards smaller than the part count starve no part, and only passes
  whose shards hold no sample at all count as empty (every part alike). With even_batches, a part
  with no batch of its own to repeat (dealt nothing, or only empty or failing shards) while the
  others yield some takes the first ``batch_size`` rows (cycled) of the first shard of the epoch's
  key list, in the source's order, that holds any (and does not fail), read whole in file order:
  with ``'pad'`` as a batch of padding only.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np

SHARD_ORDER, SHARD_DEAL, WINDOW_MIX = 0x5EED, 0xDEA1, 0x317D


def _rng(*parts: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]))


def key_hash(key: Any) -> int:
    return zlib.crc32(str(key).encode("utf-8"))


class NoBatchToRepeat(Exception):
    """even_batches: a part has no full batch to repeat while the others yield some."""


@dataclass
class Config:
    keys: list
    sizes: dict  # key -> samples
    batch_size: int
    last_batch: str = "keep"
    shuffle: bool = False
    seed: int = 0
    shuffle_window: int = 1
    num_parts: int = 1
    part_index: int = 0
    deal: str = "shards"
    even_batches: bool = False
    failing: frozenset = frozenset()  # keys whose shard fails every time (on_error='skip')
    declared: dict | None = None  # shard_sizes= given to the loader (None: unknown)
    samples_per_epoch: int | None = None
    sample_id: Callable[[Any, int], Any] = field(default=lambda key, row: 1000 * key + row)
    keys_of: Callable[[int], list] | None = None  # keys(epoch) (a callable, a MixSource)
    endless: bool = False  # the keys, cycled without end, as an iterator
    context_rows: int = 0  # C: the raw rows before a key its transform sees (see with_context)


#: with_context: a sample's id names its own row and, times this, the row C back (plus one)
CONTEXT_SCALE = 10 ** 6


def with_context(cfg: Config) -> Config:
    """``context_rows=C``: the samples the transform makes from the key list as one series,
    where ``cfg.sizes`` holds each key's raw rows and ``cfg.sample_id`` names a raw row.

    The series is every key's raw rows in the key list's order; the raw row at position ``p``
    with ``p >= C`` is a sample (a window of ``C + 1`` rows ending there), its id
    ``id(p) + CONTEXT_SCALE * (1 + id(p - C))``. A key's shard holds its rows' samples, in
    order: its size is how many of its rows have ``C`` rows before them in the series.
    """
    if not cfg.context_rows:
        return cfg
    series = [(key, row) for key in cfg.keys for row in range(cfg.sizes[key])]
    first: dict = {}
    for p, (key, row) in enumerate(series):
        first.setdefault(key, p - row)
    c, base = cfg.context_rows, cfg.sample_id

    def skipped(key: Any) -> int:  # the key's first rows, without C rows before them
        return max(0, c - first.get(key, 0))

    def sample_id(key: Any, row: int) -> Any:
        p = first[key] + skipped(key) + row
        return base(key, p - first[key]) + CONTEXT_SCALE * (1 + base(*series[p - c]))

    sizes = {key: max(0, n - skipped(key)) for key, n in cfg.sizes.items()}
    return replace(cfg, sizes=sizes, sample_id=sample_id, context_rows=0)  # applied once


def keys_for(cfg: Config, epoch: int) -> list:
    """The epoch's key list, in the source's order (an endless iterator: one cycle of it)."""
    return list(cfg.keys_of(epoch)) if cfg.keys_of is not None else list(cfg.keys)


def loss_bound(parts: int, batch_size: int) -> int:
    """even_batches=True: the most samples an epoch may leave out (every part's short tail,
    and the samples no equal split of the epoch can place)."""
    return parts * (batch_size - 1) + parts - 1


def deal_for(even: Any, parts: int, sizes_known: bool, samples_per_epoch: Any,
             keys: int | None, sizes: list | None = None, batch_size: int = 1,
             skip: bool = False) -> str:
    """How the parts split the epochs (``keys``: epoch 0's key count; None when endless;
    ``sizes``: every shard's size where every epoch has the same keys; ``skip``:
    ``on_error='skip'``). even_batches=True deals whole shards only where the part dealt
    the ``len(sizes) // parts`` smallest shards would still keep within :func:`loss_bound`
    (or with ``skip``), and balanced strides otherwise."""
    few = keys is not None and keys < parts
    if parts == 1:
        return "shards"
    if samples_per_epoch is not None:
        return "turns" if few else "shards"
    if even and not sizes_known:
        return "strides" if even == "pad" else "balanced"
    if even is True and few:
        return "balanced"
    if even is True and not skip:
        if sizes is None:
            return "balanced"
        smallest = sum(sorted(sizes)[:len(sizes) // parts]) // batch_size * batch_size
        if sum(sizes) - parts * smallest > loss_bound(parts, batch_size):
            return "balanced"
    return "shards"


def epoch_keys(cfg: Config, epoch: int, part: int) -> list:
    """The shards of one part in one epoch, in order."""
    keys = keys_for(cfg, epoch)
    n = len(keys)
    if cfg.num_parts > 1 and cfg.deal == "shards" and n:
        mine = _rng(cfg.seed, epoch, SHARD_DEAL).permutation(n)[part::cfg.num_parts]
        order = list(mine) if cfg.shuffle else sorted(mine)
    elif cfg.shuffle and n:
        order = list(_rng(cfg.seed, epoch, SHARD_ORDER).permutation(n))
    else:
        order = list(range(n))
    return [keys[i] for i in order]


def borrowed(cfg: Config, epoch: int) -> list | None:
    """The batch a part with none of its own yields (see the module doc), or None."""
    for key in keys_for(cfg, epoch):
        n = cfg.sizes[key]
        if key in cfg.failing or not n:
            continue
        rows = min(n, cfg.batch_size)
        return [cfg.sample_id(key, i % rows) for i in range(cfg.batch_size)]
    return None


def shard_rows(cfg: Config, epoch: int, part: int, key: Any, index: int = 0,
               before: int = 0) -> list[int]:
    """The rows of a shard one part reads, in order (``index``: its position in the pass;
    ``deal='turns'``: the shard's first row goes to part ``(epoch + index) % parts``;
    ``before``: the rows of the epoch's shards before it; ``deal='balanced'``: its first row
    goes to part ``before % parts``)."""
    size = cfg.sizes[key]
    rows = list(range(size))
    if cfg.shuffle and size > 1:
        rows = [int(r) for r in _rng(cfg.seed, epoch, key_hash(key)).permutation(size)]
    if cfg.deal == "samples" and cfg.num_parts > 1:
        rows = rows[part::cfg.num_parts][:size // cfg.num_parts]
    if cfg.deal == "strides" and cfg.num_parts > 1:
        rows = rows[part::cfg.num_parts]
    if cfg.deal == "turns" and cfg.num_parts > 1:
        rows = rows[(part - epoch - index) % cfg.num_parts::cfg.num_parts]
    if cfg.deal == "balanced" and cfg.num_parts > 1:
        rows = rows[(part - before) % cfg.num_parts::cfg.num_parts]
    return rows


def rows_before(cfg: Config, epoch: int, part: int) -> list[int]:
    """The rows of the epoch's shards before each of a part's shards (failing ones hold 0)."""
    out, total = [], 0
    for key in epoch_keys(cfg, epoch, part):
        out.append(total)
        total += 0 if key in cfg.failing else cfg.sizes[key]
    return out


def epoch_units(cfg: Config, epoch: int, part: int) -> list[list]:
    """An epoch's units for one part: lists of sample ids, read front to back."""
    shards = []
    befores = rows_before(cfg, epoch, part)
    for index, key in enumerate(epoch_keys(cfg, epoch, part)):
        rows = [] if key in cfg.failing else shard_rows(cfg, epoch, part, key, index,
                                                        befores[index])
        shards.append([cfg.sample_id(key, r) for r in rows])
    k = cfg.shuffle_window
    if k == 1:
        return [s for key, s in zip(epoch_keys(cfg, epoch, part), shards)
                if key not in cfg.failing]
    units = []
    for t in range(len(shards) + k - 1):
        members = []
        for j in range(max(0, t - k + 1), min(t, len(shards) - 1) + 1):
            q, r = divmod(len(shards[j]), k)
            piece = t - j
            start = piece * q + min(piece, r)
            members += [(j, row) for row in range(start, start + q + (piece < r))]
        if len(members) > 1:
            order = _rng(cfg.seed, epoch, t, WINDOW_MIX).permutation(len(members))
            members = [members[i] for i in order]
        units.append([shards[j][row] for j, row in members])
    return units


def part_total(cfg: Config, epoch: int, part: int) -> int:
    """A part's samples in an epoch as the declared sizes count them (even_batches' limit)."""
    sizes = cfg.declared if cfg.declared is not None else {  # what the parts see
        key: 0 if key in cfg.failing else n for key, n in cfg.sizes.items()}
    total, parts = 0, cfg.num_parts
    before = 0
    for index, key in enumerate(epoch_keys(cfg, epoch, part)):
        n = sizes[key]
        if cfg.deal == "balanced" and parts > 1:
            before, n = before + n, len(range((part - before) % parts, n, parts))
        if cfg.deal == "samples" and parts > 1:
            n //= parts
        elif cfg.deal == "strides" and parts > 1:
            n = len(range(part, n, parts))
        elif cfg.deal == "turns" and parts > 1:
            n = len(range((part - epoch - index) % parts, n, parts))
        total += n
    return total


def pad_count(cfg: Config, epoch: int) -> int:
    """even_batches='pad': the batches every part yields (the largest part's, rounded up)."""
    most = max(part_total(cfg, epoch, p) for p in range(cfg.num_parts))
    return -(-most // cfg.batch_size)


def even_limit(cfg: Config, epoch: int) -> int | None:
    """The batch count every part yields with even_batches (None: equal by construction)."""
    if not cfg.even_batches or cfg.deal == "samples" or cfg.num_parts == 1:
        return None  # equal by construction: every full batch
    return min(part_total(cfg, epoch, p) for p in range(cfg.num_parts)) // cfg.batch_size


def padded(cfg: Config, epochs: int, part: int | None = None) -> list[list[tuple]]:
    """even_batches='pad': every epoch's ``(sample ids, padding rows)`` for one part."""
    part = cfg.part_index if part is None else part
    bs = cfg.batch_size
    out = []
    for epoch in range(epochs):
        stream = [s for unit in epoch_units(cfg, epoch, part) for s in unit]
        epoch_batches = [(stream[i:i + bs], 0) for i in range(0, len(stream), bs)]
        if epoch_batches and len(epoch_batches[-1][0]) < bs:
            tail = epoch_batches[-1][0]
            epoch_batches[-1] = (tail + [tail[i % len(tail)] for i in range(bs - len(tail))],
                                 bs - len(tail))
        count = pad_count(cfg, epoch)
        if len(epoch_batches) < count:
            last = epoch_batches[-1][0] if epoch_batches else borrowed(cfg, epoch)
            if last is None:
                raise NoBatchToRepeat(f"epoch {epoch}: part {part} has no batch")
            epoch_batches += [(last, bs)] * (count - len(epoch_batches))
        out.append(epoch_batches[:count])
    return out


EMPTY_PASSES = 16  # samples_per_epoch: passes in a row without a sample before it gives up


class NoSamples(Exception):
    """samples_per_epoch: EMPTY_PASSES passes over the keys in a row gave a part no sample."""


def sample_stream(cfg: Config, epochs: int, part: int) -> list:
    """samples_per_epoch: the samples ``epochs`` epochs read, from the passes over the keys."""
    needed = epochs * cfg.samples_per_epoch
    stream: list = []
    key_pass = empty = 0
    if cfg.endless:  # one pass without end: this part's keys p, p + parts, ... of the cycle
        index = part
        while len(stream) < needed:
            key = cfg.keys[index % len(cfg.keys)]
            stream += [cfg.sample_id(key, r) for r in shard_rows(cfg, 0, part, key)]
            index += cfg.num_parts
        return stream[:needed]
    while len(stream) < needed:
        samples = [s for unit in epoch_units(cfg, key_pass, part) for s in unit]
        if cfg.deal == "turns" and cfg.num_parts > 1:  # every part sees the pass alike
            held = any(cfg.sizes[k] for k in keys_for(cfg, key_pass) if k not in cfg.failing)
        else:
            held = bool(samples)
        empty = 0 if held else empty + 1
        if empty == EMPTY_PASSES:
            raise NoSamples(f"part {part}: {EMPTY_PASSES} passes without a sample")
        stream += samples
        key_pass += 1
    return stream[:needed]


def fixed_epochs(cfg: Config, epochs: int, part: int | None = None) -> list[list[tuple]]:
    """samples_per_epoch: every epoch's ``(sample ids, padding rows)`` for one part."""
    part = cfg.part_index if part is None else part
    n, bs = cfg.samples_per_epoch, cfg.batch_size
    stream = sample_stream(cfg, epochs, part)
    out = []
    carry: list = []
    for epoch in range(epochs):
        samples = carry + stream[epoch * n:(epoch + 1) * n]
        full = len(samples) // bs
        epoch_batches = [(samples[i * bs:(i + 1) * bs], 0) for i in range(full)]
        tail = samples[full * bs:]
        carry = tail if cfg.last_batch == "rollover" else []
        if tail and cfg.even_batches == "pad":
            epoch_batches.append((tail + [tail[i % len(tail)] for i in range(bs - len(tail))],
                                  bs - len(tail)))
        elif tail and cfg.last_batch == "keep" and not cfg.even_batches:
            epoch_batches.append((tail, 0))
        out.append(epoch_batches)
    return out


def batches(cfg: Config, epochs: int, part: int | None = None) -> list[list[list]]:
    """Every epoch's batches (lists of sample ids) for one part: ``result[epoch][i]``.

    Raises :class:`NoBatchToRepeat` for an epoch in which even_batches cannot be kept.
    """
    if cfg.samples_per_epoch is not None:
        return [[ids for ids, _ in epoch] for epoch in fixed_epochs(cfg, epochs, part)]
    if cfg.even_batches == "pad":
        return [[ids for ids, _ in epoch] for epoch in padded(cfg, epochs, part)]
    part = cfg.part_index if part is None else part
    bs = cfg.batch_size
    carry: list = []
    out = []
    for epoch in range(epochs):
        stream = carry + [s for unit in epoch_units(cfg, epoch, part) for s in unit]
        full = len(stream) // bs
        epoch_batches = [stream[i * bs:(i + 1) * bs] for i in range(full)]
        tail = stream[full * bs:]
        carry = tail if cfg.last_batch == "rollover" else []
        if cfg.even_batches:
            limit = even_limit(cfg, epoch)
            if limit is not None:
                if len(epoch_batches) < limit:
                    last = epoch_batches[-1] if epoch_batches else borrowed(cfg, epoch)
                    if last is None:
                        raise NoBatchToRepeat(f"epoch {epoch}: part {part} has no batch")
                    epoch_batches += [last] * (limit - len(epoch_batches))
                epoch_batches = epoch_batches[:limit]
        elif tail and cfg.last_batch == "keep":
            epoch_batches.append(tail)
        out.append(epoch_batches)
    return out
