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
