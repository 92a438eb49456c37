"""The tree is lint-clean: ``ruff check`` (``ruff.toml``: pycodestyle, pyflakes, import order,
bugbear) finds nothing in the package, its tests, examples and tools."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(120)
def test_ruff_finds_nothing_in_the_tree():
    """ruff comes with the ``test`` extra; its cache (``.ruff_cache``, which ruff git-ignores
    itself) is where a contributor's own ``ruff check .`` keeps it."""
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "."],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-2000:]


#: issue 36: objects small enough to read in minutes (the core: outside cli/ and tools/)
MAX_CLASS_LINES, MAX_FUNCTION_LINES = 300, 60


def test_no_class_or_function_of_the_core_is_too_long_to_read():
    """No class of the core is over 300 lines and no function over 60 (``def`` or ``class``
    line to its last line, docstrings included): where one grows past them, it holds more
    than one concept."""
    import ast
    import pathlib

    package = pathlib.Path(ROOT, "gluon_stream")
    long = []
    for path in sorted(package.rglob("*.py")):
        if {"cli", "tools"} & set(path.relative_to(package).parts):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                limit = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
                if lines > limit:
                    long.append(f"{path.relative_to(package)}:{node.lineno} {node.name}: {lines}")
    assert not long, long
