"""The stages of a loader's chain, private, one module per stage; :mod:`gluon_stream.loader`
maps its arguments onto them (``docs/design.md`` draws the chain).

The stages, in the order data flows through them:

* ``keys``: which keys this part reads in each pass and which rows of each shard (the deal,
  its elastic remainders, the shard sizes it knows, the rank it resolves);
* ``produce``: production ahead: the stream (:class:`~gluon_stream.ShardStream`), a pass's
  prefetch window, generations ahead into the cache, the producers, one shard built, the error
  policy; ``context`` is its ``context_rows`` parameter;
* ``feed``: shards as the planner's units: one shard, or a shuffle window's mix;
* ``batching``: the planner: which samples form which batch, the carry, a resume's start;
* ``batch_paths``: planned batches into data: slices, or per-sample work on workers;
* ``even``: equal counts across ranks: repeat, pad, borrow;
* ``epoch``: epochs: a pass's stages driven, where it stands, where the next starts, how many
  batches it has;
* ``provenance``: where a delivered batch's samples came from (``provenance=True``).

What the stages share: ``contracts`` (the Protocols between them), ``settings`` (what a loader
decides for every pass), ``offsets`` (rows before each shard, ``deal='balanced'``), ``state``
(the chain's state, encoded and checked), and elastic resume's ``ranks``, ``resolve``,
``quotas`` and ``window_cuts``. Memory (``memory_budget``) is below them, in ``_memory``.
"""
