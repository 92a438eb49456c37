"""A griffe extension for the API reference: ``Example:`` sections are doctests.

gluon_stream's docstrings head their doctests ``Example:`` (house style, Google style's
singular). griffe's Google parser reads only ``Examples:`` as an examples section; anything
else with a colon becomes an admonition whose ``>>>`` lines would render as Markdown text
(``arrays[0][0]`` as a link). mkdocs.yml loads this file, which renames the heading before
griffe parses the docstring.
"""
from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE_HEADING = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    """Read a docstring's ``Example:`` section as ``Examples:``."""

    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE_HEADING.sub(r"\1Examples:", obj.docstring.value)
