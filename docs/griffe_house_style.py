"""A griffe extension for the API reference: gluon_stream's docstrings read as Markdown.

The house style writes Google-style docstrings with two habits that griffe would render
literally: doctests under ``Example:`` (griffe's Google parser reads only ``Examples:`` as
examples; anything else with a colon is an admonition whose ``>>>`` lines render as Markdown
text, ``arrays[0][0]`` as a link) and Sphinx roles (``:class:`~gluon_stream.Stats```). Before
griffe parses a docstring, this renames the heading and turns each role into inline code
(``Stats``; with ``~`` the last part of the name, as Sphinx shows it). mkdocs.yml loads it.
"""
from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE_HEADING = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)
_ROLE = re.compile(r":(?:class|func|meth|mod|attr|exc|data|obj):`(~?)([^`]+)`")


def _code(match: re.Match) -> str:
    tilde, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


class HouseStyle(griffe.Extension):
    """Read ``Example:`` as ``Examples:`` and Sphinx roles as inline code."""

    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            value = _EXAMPLE_HEADING.sub(r"\1Examples:", obj.docstring.value)
            obj.docstring.value = _ROLE.sub(_code, value)
