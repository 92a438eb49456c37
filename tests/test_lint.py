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


#: issue 36: following the data of the default path reads this many of the package's modules
MAX_WALK_MODULES = 15

WALK = """
import json, sys, threading
import numpy as np
import gluon_stream as gs

def rows(key):
    return np.full((40, 4), key, dtype="float32"), np.arange(40, dtype="float32")

def first_epoch():
    loader = gs.StreamLoader(gs.FunctionSource(range(6), rows), batch_size=32)
    batches = sum(1 for _ in loader)
    return loader, batches

warm, _ = first_epoch()  # imports done and MXNet's engine up: they are not the walk
warm.close()
seen = set()

def note(frame, event, arg):
    if event == "call" and "/gluon_stream/" in frame.f_code.co_filename:
        seen.add(frame.f_code.co_filename.split("/gluon_stream/")[-1])

threading.setprofile(note)
sys.setprofile(note)
loader, batches = first_epoch()
sys.setprofile(None)
threading.setprofile(None)
loader.close()
print(json.dumps({"batches": batches, "modules": sorted(seen)}))
"""


@pytest.mark.timeout(120)
def test_a_new_loaders_first_epoch_runs_code_in_few_modules():
    """From a new loader's construction to the end of its first epoch on the default path
    (``FunctionSource`` -> ``StreamLoader`` -> the loop), the loop and every thread run code
    in at most 15 of the package's modules: one per stage, not one per feature (34 before
    the stages were consolidated). Profiled in a new process, after a warm-up loader."""
    import json

    out = subprocess.run([sys.executable, "-c", WALK], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-3000:]
    walk = json.loads(out.stdout.strip().splitlines()[-1])
    assert walk["batches"] == 8  # 6 shards of 40 rows, batches of 32: the walk is real
    assert "_stages/produce.py" in walk["modules"] and "loader.py" in walk["modules"]
    assert len(walk["modules"]) <= MAX_WALK_MODULES, walk["modules"]
