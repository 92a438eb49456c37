"""The package's types are a promise (``py.typed`` ships): mypy finds nothing in it."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(600)
def test_mypy_finds_nothing_in_the_package():
    """mypy keeps its cache where a contributor's own ``python -m mypy`` does (``.mypy_cache``,
    git-ignored): it re-checks what changed and what depends on it, so a second run takes
    seconds; a fresh clone checks everything once."""
    out = subprocess.run([sys.executable, "-m", "mypy", "--config-file", "setup.cfg",
                          "--cache-dir", os.path.join(ROOT, ".mypy_cache")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-2000:]
    assert "Success: no issues found" in out.stdout


def test_the_package_ships_py_typed():
    import gluon_stream

    assert os.path.isfile(os.path.join(os.path.dirname(gluon_stream.__file__), "py.typed"))
