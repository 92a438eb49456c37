"""Plumbing shared by the core, private: no stage of a pass lives here.

``validate`` (argument checks), ``closing`` and ``lifecycle`` (waits, closing, forks, interpreter
exit, the thread pool and the cores it may use), ``files`` (temporary names, removal),
``random`` (seeded generators), ``retry`` (what is worth another attempt), ``fsspec`` (remote
file systems), ``columns`` (what a function returns, as columns MXNet can batch),
``progress`` and ``timeline`` (the progress bar and the timeline plot), ``libc``.
"""
