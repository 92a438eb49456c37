"""The batch planner, property-tested: for random shard sizes, batch sizes, last_batch modes and
resume points, every sample exactly once, full batches across boundaries, and a resume at any
planned position gives the same remaining plan. Pure Python: no MXNet, no arrays."""
from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gluon_stream._stages.batching import Batch, BatchPlanner, Position, Segment

sizes_st = st.lists(st.integers(min_value=0, max_value=23), min_size=0, max_size=9)
batch_st = st.integers(min_value=1, max_value=9)
mode_st = st.sampled_from(["keep", "discard", "rollover"])


def samples(batch: Batch) -> list[tuple[int, int, int]]:
    """(epoch, unit, row) of every sample of a planned batch, in order."""
    return [(s.epoch, s.unit, row) for s in batch.segments for row in range(s.start, s.stop)]


def plan_epoch(sizes, batch_size, mode, start, skipped=()):
    """Every batch of one epoch from ``start`` (units before it are not added), and the planner."""
    planner = BatchPlanner(batch_size, mode, start)
    batches = []
    for unit, n in enumerate(sizes):
        if unit < start.unit or unit in skipped:
            continue
        batches.extend(planner.add(unit, n, key=f"k{unit}").batches())
    tail, end = planner.finish()
    if tail is not None:
        batches.append(tail)
    return batches, end


@settings(max_examples=300, deadline=None)
@given(sizes=sizes_st, batch_size=batch_st, mode=mode_st)
def test_every_sample_once_and_full_batches_across_unit_boundaries(sizes, batch_size, mode):
    batches, end = plan_epoch(sizes, batch_size, mode, Position(0))
    delivered = [s for b in batches for s in samples(b)]
    every = [(0, u, r) for u, n in enumerate(sizes) for r in range(n)]
    assert len(delivered) == len(set(delivered))
    assert delivered == every[:len(delivered)]  # in order: shards are read front to back
    total, rest = sum(sizes), sum(sizes) % batch_size
    if mode == "keep":
        assert delivered == every
    else:
        assert len(delivered) == total - rest
    assert all(b.size == batch_size for b in batches[:-1])
    if batches:
        assert 0 < batches[-1].size <= batch_size
        assert mode == "keep" or batches[-1].size == batch_size
    carried = [s for seg in end.carry for s in samples(Batch((seg,), Position(0)))]
    assert carried == (every[total - rest:] if mode == "rollover" else [])


@settings(max_examples=200, deadline=None)
@given(sizes=sizes_st, batch_size=batch_st, mode=mode_st, data=st.data())
def test_resuming_at_any_planned_position_gives_the_same_remaining_plan(sizes, batch_size, mode,
                                                                         data):
    reference, _ = plan_epoch(sizes, batch_size, mode, Position(0))
    if not reference:
        return
    k = data.draw(st.integers(min_value=0, max_value=len(reference) - 1))
    after = reference[k].after
    if after.end:  # the epoch's short tail: nothing of this epoch follows it
        assert k == len(reference) - 1 and mode == "keep"
        return
    resumed, _ = plan_epoch(sizes, batch_size, mode, after)
    assert [samples(b) for b in resumed] == [samples(b) for b in reference[k + 1:]]
    # and the resumed plan's positions agree, so a second resume is exact too
    assert [b.after for b in resumed] == [b.after for b in reference[k + 1:]]


@settings(max_examples=200, deadline=None)
@given(sizes=sizes_st, next_sizes=sizes_st, batch_size=batch_st)
def test_the_rollover_remainder_opens_the_next_epoch(sizes, next_sizes, batch_size):
    first, end = plan_epoch(sizes, batch_size, "rollover", Position(0))
    assert end.end and end.epoch == 0
    start = end.next_epoch()
    assert start.epoch == 1 and start.carried == sum(sizes) % batch_size
    second, _ = plan_epoch(next_sizes, batch_size, "keep", start)
    rolled = [(0, u, r) for seg in start.carry for u, r in [(seg.unit, x)
                                                              for x in range(seg.start, seg.stop)]]
    delivered = [s for b in second for s in samples(b)]
    assert delivered[:len(rolled)] == rolled  # the remainder comes first ...
    assert len(delivered) == len(rolled) + sum(next_sizes)  # ... then all of epoch 1, once
    assert not set(rolled) & {s for b in first for s in samples(b)}


@settings(max_examples=150, deadline=None)
@given(sizes=sizes_st, batch_size=batch_st, data=st.data())
def test_skipped_units_leave_no_gap_in_the_batches(sizes, batch_size, data):
    skipped = set(data.draw(st.lists(st.integers(0, max(0, len(sizes) - 1)), max_size=3)))
    batches, _ = plan_epoch(sizes, batch_size, "keep", Position(0), skipped)
    delivered = [s for b in batches for s in samples(b)]
    assert delivered == [(0, u, r) for u, n in enumerate(sizes) if u not in skipped
                         for r in range(n)]
    assert all(b.size == batch_size for b in batches[:-1])


def test_a_unit_that_ends_exactly_on_a_batch_moves_the_position_to_the_next_unit():
    planner = BatchPlanner(4, "keep", Position(3))
    first, second = planner.add(0, 8).batches()
    assert first.after == Position(3, 0, 4) and second.after == Position(3, 1, 0)


def test_leftovers_name_the_unit_rows_they_carry_and_flush_delivers_them():
    planner = BatchPlanner(4, "keep", Position(0))
    plan = planner.add(0, 6, key="a")
    assert [b.sizes for b in plan.batches()] == [(4,)]
    assert plan.leftover == (Segment(0, 0, 4, 6),) and plan.leftover[0].key == "a"
    small = planner.add(1, 1, key="b")  # too few to complete a batch: everything waits
    assert not list(small.batches()) and small.leftover == (Segment(0, 1, 0, 1),)
    tail = planner.flush(unit=2)  # unit 2 failed: the carried samples go out first
    assert tail.sizes == (2, 1) and tail.after == Position(0, 2, 0)
    assert planner.carry == () and planner.flush(unit=3) is None
    discard = BatchPlanner(4, "discard", Position(0))
    discard.add(0, 3)
    assert discard.flush(unit=1) is None and discard.carry == ()


def test_counters_of_a_unit_plan_are_lazy_ranges_not_lists():
    plan = BatchPlanner(32, "keep", Position(0)).add(0, 10 ** 9)
    assert len(plan) == 10 ** 9 // 32 and isinstance(plan.full, range)


@pytest.mark.parametrize("bad, match", [
    (lambda p: (p.add(2, 5), p.add(1, 5)), "increasing order"),
    (lambda p: p.add(0, -1), "negative"),
])
def test_misuse_is_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        bad(BatchPlanner(4, "keep", Position(0)))


def test_a_position_that_does_not_fit_the_data_is_refused():
    with pytest.raises(ValueError, match="data changed"):
        BatchPlanner(4, "keep", Position(0, 1, 9)).add(1, 5)
    with pytest.raises(ValueError, match="more than a batch"):
        BatchPlanner(2, "keep", Position(0, 0, 0, (Segment(0, 0, 0, 3),)))
    with pytest.raises(ValueError, match="last_batch"):
        BatchPlanner(2, "pad", Position(0))


def test_every_batch_is_planned_once_even_for_many_units():
    planner = BatchPlanner(7, "keep", Position(0))
    counts = collections.Counter()
    for unit in range(200):
        for batch in planner.add(unit, (unit * 37) % 11).batches():
            counts.update(samples(batch))
    assert set(counts.values()) == {1}


# -- ranks: how the parts split an epoch so that they agree (pure, no MXNet) --------------------
@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.integers(0, 20), max_size=6), parts=st.integers(2, 5),
       even=st.sampled_from([False, True, "pad"]), known=st.booleans(),
       fixed=st.booleans(), batch_size=st.integers(1, 6), seed=st.integers(0, 9))
def test_the_deal_gives_every_part_a_share_or_equal_counts(sizes, parts, even, known, fixed,
                                                           batch_size, seed):
    """Whatever the topology, the deal chosen from what every rank knows alike leaves no rank
    behind: with fewer keys than ranks no rank is dealt nothing where that would stop it
    (samples_per_epoch, even_batches=True); even_batches=True's strides are balanced (the
    parts' totals differ by one at most); the counts every part yields come from every part's
    samples, the same on all."""
    import random

    from gluon_stream._stages.keys import part_count
    from gluon_stream._stages.ranks import choose_deal, even_count

    deal, why = choose_deal(even, fixed, known, parts, len(sizes), batch_size=batch_size,
                            sizes=sizes if known else None)
    assert (deal == "shards") == (why == "")
    if len(sizes) < parts and (fixed or even is True):
        assert deal != "shards", "a rank would be dealt no key"
    if deal == "shards":
        order = list(range(len(sizes)))
        random.Random(seed).shuffle(order)
        totals = [sum(sizes[k] for k in order[p::parts]) for p in range(parts)]
    else:
        befores = [sum(sizes[:j]) if deal == "balanced" else j for j in range(len(sizes))]
        totals = [sum(part_count(n, parts, p, deal, before if deal != "strides" else None)
                      for n, before in zip(sizes, befores)) for p in range(parts)]
        if deal == "samples":
            assert len(set(totals)) == 1  # equal by construction, nothing known ahead
        else:
            assert sum(totals) == sum(sizes)  # strides drop nothing
        if deal == "balanced":
            assert max(totals) - min(totals) <= 1  # they go on from shard to shard
    if even == "pad":
        count = even_count("pad", totals, batch_size)
        assert count * batch_size >= max(totals) > (count - 1) * batch_size or count == 0
    elif even:
        count = even_count(True, totals, batch_size)
        assert all(count * batch_size <= t for t in totals)
        assert (count + 1) * batch_size > min(totals)
        if not fixed:  # at most every part's short tail and total % parts left out
            assert sum(sizes) - parts * count * batch_size <= parts * batch_size - 1


@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.integers(0, 40), max_size=12), parts=st.integers(1, 6),
       start=st.integers(0, 11))
def test_strides_that_go_on_from_the_last_shard_balance_the_parts(sizes, parts, start):
    """The shared dealing rule (stream, counts and elastic merge), issue 24 §4: with the rows
    dealt before each shard known (``before``), every shard's strides go on where the last
    one's stopped, so over the whole run, and after every shard, the parts' totals differ by
    one sample at most; each shard's rows are dealt once; the counts match the rows."""
    import numpy as np

    from gluon_stream._stages.keys import part_count, part_rows

    totals, before = [0] * parts, start  # ``start``: rows dealt ahead of the first shard
    for n in sizes:
        rows = np.arange(n)
        dealt = [part_rows(rows, parts, p, "strides", before) for p in range(parts)]
        assert sorted(np.concatenate(dealt).tolist()) == list(range(n))
        for p in range(parts):
            assert part_count(n, parts, p, "strides", before) == len(dealt[p])
            totals[p] += len(dealt[p])
        before += n
        assert max(totals) - min(totals) <= 1, (sizes, parts, totals)
    # row k of the run (counting from ``start``) goes to part k % parts, as one long shard's
    ahead = [len(range((p - start) % parts, sum(sizes), parts)) for p in range(parts)]
    assert totals == ahead


def test_strides_that_start_at_part_0_leave_the_first_parts_ahead():
    """Issue 24 §4's example: 9 shards of 23 rows on 3 ranks. Each shard's strides starting
    at part 0 hold 72/72/63; going on from the last shard's, 69 each; 'samples' cuts every
    stride to 7 (63 each, 18 rows of the epoch read by no rank)."""
    from gluon_stream._stages.keys import part_count

    def totals(deal, turn):
        return [sum(part_count(23, 3, p, deal, 23 * j if turn else None) for j in range(9))
                for p in range(3)]

    assert totals("strides", False) == [72, 72, 63]
    assert totals("strides", True) == [69, 69, 69]
    assert totals("samples", True) == totals("samples", False) == [63, 63, 63]
