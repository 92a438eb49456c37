"""The stages of a loader's chain, private; :mod:`gluon_stream.loader` and
:class:`~gluon_stream.ShardStream` wire them (``docs/design.md`` draws the chain).

The stages, in the order data flows through them:

* keys: ``deal`` (this part's keys of each pass and each shard's rows; a pass's key cursor),
  on ``keys`` (an epoch's keys dealt to the parts, an endless iterator's kept keys);
* produce: ``run`` (a pass's prefetch window, shards handed out in order), ``ahead`` (shards
  generated into the cache beyond it), ``produce`` (the producers' work and the error policy),
  ``build`` (one shard: raw, context, transform, this part's rows, the consumer's form),
  ``admission`` (memory admitted before it is allocated);
* window: ``feed`` (shards as the planner's units: one shard, or a shuffle window);
* plan: ``batching`` (which samples form which batch, the carry, where a resume starts);
* slices or per-sample: ``batch_paths`` (planned batches into data);
* even: ``even`` (equal counts across ranks: repeat, pad, borrow);
* epochs: ``epoch`` (one epoch's runs, placement), ``pass_state`` (the stages' positions
  composed after each batch), ``starts`` (where each pass starts), ``rebuild`` (a resumed
  position's units made again).

What they share: ``settings`` (what a loader decides for every pass), ``sizes`` and ``counts``
(shard sizes known without producing them, batch counts), ``offsets`` (rows before each shard,
``deal='balanced'``), ``shard`` and ``reservations`` (a made shard; a producer's reservations),
``producers`` (the pool and its throttle), ``context`` (``context_rows``), ``provenance``
(``provenance=True``), ``tuning`` (the ``memory_budget`` tuner), ``state`` (resume states,
encoded and checked), ``contracts`` (the Protocols between the stages), and elastic resume's
``ranks``, ``remainder``, ``resolve``, ``quotas`` and ``window_cuts``.
"""
