"""Tooling around the library: the built-in generator, the demo's model and the benchmarks.

Nothing in the streaming core imports this package; the CLI (:mod:`gluon_stream.cli`) does.
"""
