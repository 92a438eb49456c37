"""Plumbing shared by the core, private: no stage of a pass lives here.

``validate`` (argument checks), ``closing`` and ``lifecycle`` (waits, closing, forks, interpreter
exit), ``files`` (temporary names, removal), ``random`` (seeded generators), ``cores`` (usable
cores), ``retry`` (what is worth another attempt), ``fsspec`` (remote file systems),
``distributed`` (ranks from kvstore, Horovod or the environment), ``columns`` and ``batchable``
(what a function returns, as columns MXNet can batch), ``progress`` and ``timeline`` (the
progress bar and the timeline plot).
"""
