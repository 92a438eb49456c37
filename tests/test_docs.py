"""The docs say what the code does: their marked code blocks run, and the README's links and
set-up commands hold.

A ```` ```python ```` block right after a line ``<!-- runnable -->`` in README.md or any page
under docs/ is executed. Each page's blocks run in order in one fresh interpreter (a child
process, bounded by a timeout) in a temporary directory, each block in a namespace of its own,
as a reader would paste it; a traceback names the page and line. Unmarked blocks are sketches
(they use your generator, your cluster) and are not run. ``mkdocs build --strict`` (CI's docs
part) checks the links between docs pages; the README is not part of that site, so its links
are checked here.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path
from typing import Callable

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
MARKER = "<!-- runnable -->"
TIMEOUT_S = 240


def name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def runnable_blocks(page: Path) -> list[tuple[int, str]]:
    """``(line of the block's first code line, code)`` for each marked block of a page."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if line.strip() == MARKER:
            where = f"{name(page)}:{i + 1}"
            assert i + 1 < len(lines) and lines[i + 1].strip() == "```python", \
                f"{where}: {MARKER} must be the line right before a ```python block"
            end = lines.index("```", i + 2)
            blocks.append((i + 3, "\n".join(lines[i + 2:end])))
    return blocks


def run_page(page: Path, cwd: Path) -> str:
    """Run a page's marked blocks in one child interpreter; return its stdout."""
    statements = [f"exec(compile({chr(10) * (line - 1) + code!r}, {name(page)!r}, 'exec'), "
                  "{'__name__': '__main__'})" for line, code in runnable_blocks(page)]
    out = subprocess.run([sys.executable, "-c", "\n".join(statements)], cwd=cwd,
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    assert out.returncode == 0, (f"a runnable block of {name(page)} failed:\n"
                                 f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out.stdout


def check_readme(out: str, cwd: Path) -> None:
    assert "epoch 1: last batch's loss" in out and "stall %" in out


def check_module_api(out: str, cwd: Path) -> None:
    assert "DataDesc[data,(100, 16)" in out


def check_monitoring(out: str, cwd: Path) -> None:
    assert "stall %" in out
    assert (cwd / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((cwd / "trace.json").read_text())["traceEvents"]


def check_batches(out: str, cwd: Path) -> None:
    assert "keep [[8, 8, 8, 8, 7], [8, 8, 8, 8, 7]]" in out
    assert "discard [[8, 8, 8, 8], [8, 8, 8, 8]]" in out
    assert "rollover [[8, 8, 8, 8], [8, 8, 8, 8, 8]]" in out
    assert "loss 1e+12 from key 2, row 7, epoch 0" in out  # provenance finds the spike


def check_errors(out: str, cwd: Path) -> None:
    assert "a batch of key 0.0\nShardError, key 1: " in out
    assert "[0.0, 2.0] skipped: 1" in out


def check_usage(out: str, cwd: Path) -> None:
    assert "[6, 6]" in out


def check_resume(out: str, cwd: Path) -> None:
    assert re.search(r"resumed after 3 batches: the same \d+ batches followed", out), out


# What some pages' blocks print or write, beyond running without an error.
CHECKS: dict[str, Callable[[str, Path], None]] = {
    "README.md": check_readme,
    "docs/batches.md": check_batches,
    "docs/errors.md": check_errors,
    "docs/usage.md": check_usage,
    "docs/module-api.md": check_module_api,
    "docs/monitoring.md": check_monitoring,
    "docs/resume.md": check_resume,
}
PAGES_TO_RUN = [page for page in PAGES if runnable_blocks(page)]


def test_the_docs_have_runnable_blocks_and_every_checked_page_has_some():
    assert set(CHECKS) <= {name(page) for page in PAGES_TO_RUN}
    assert sum(len(runnable_blocks(page)) for page in PAGES) >= len(CHECKS)


@pytest.mark.parametrize("page", PAGES_TO_RUN, ids=name)
def test_runnable_blocks_run(page, tmp_path):
    out = run_page(page, tmp_path)
    check = CHECKS.get(name(page))
    if check is not None:
        check(out, tmp_path)


@pytest.mark.parametrize("marker", ["demo command", "test command"])
def test_the_readme_has_a_one_line_command_after_each_marker_and_install_shows_it(marker):
    """.ci/run runs the bash block right after ``<!-- demo command -->`` and after
    ``<!-- test command -->``; docs/install.md shows the same commands."""
    lines = README.read_text(encoding="utf-8").splitlines()
    assert lines.count(f"<!-- {marker} -->") == 1
    i = lines.index(f"<!-- {marker} -->")
    assert lines[i + 1] == "```bash" and lines[i + 3] == "```", lines[i:i + 4]
    assert lines[i + 2].startswith("python3 -m venv .venv && ")
    assert f"```bash\n{lines[i + 2]}\n```" in (ROOT / "docs" / "install.md").read_text()


# What a newcomer must find in the README: every capability, by the name they would use.
CAPABILITIES = ("CommandSource", "FunctionSource", "FileSource", "prefetch", "producers='auto'",
                "shuffle_window", "sample_transform", "npx.set_np()", "mx.np.ndarray",
                "memory_budget=", "state_dict()", "gs.merge_states", "gs.StreamCheckpoint",
                "samples_per_epoch", "gs.MixSource", "even_batches", "Horovod", "kvstore",
                "dask", "cache", "diagnose()", "gs.MetricsExporter", "TensorBoard",
                "StreamIter", "gluon-stream demo")


def test_the_readme_names_every_capability_and_dates_its_figures():
    text = README.read_text(encoding="utf-8")
    missing = [c for c in CAPABILITIES if c not in text]
    assert not missing, f"README.md does not name {missing}"
    fast = next(line for line in text.splitlines() if line.startswith("* **Fast**"))
    paragraph = text[text.index(fast):].split("\n\n")[0]
    assert re.search(r"measured (on )?20\d\d-\d\d-\d\d", paragraph), paragraph


def slug(heading: str) -> str:
    """The anchor of a heading, as Python-Markdown's toc (and, for ours, GitHub) makes it."""
    text = re.sub(r"`|\*|\[|\]\([^)]*\)", "", heading)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
    return {slug(m) for m in re.findall(r"^#+ (.*)$", text, re.M)}


def test_the_readme_links_to_files_and_headings_that_exist():
    links = re.findall(r"\]\(([^)#\s]+)(?:#([^)\s]+))?\)", README.read_text(encoding="utf-8"))
    local = [(target, anchor) for target, anchor in links if "://" not in target]
    assert len(local) >= 10
    for target, anchor in local:
        path = ROOT / target
        assert path.exists(), f"README links to {target}, which does not exist"
        if anchor:
            assert anchor in anchors(path), f"README links to {target}#{anchor}: no such heading"


def test_the_site_lists_every_page():
    """mkdocs.yml's nav and the table in docs/index.md name every page under docs/."""
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    nav = set(re.findall(r":\s*(\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M))
    index = set(re.findall(r"\]\(([\w/-]+\.md)\)", (ROOT / "docs/index.md").read_text()))
    assert nav == pages
    assert index == pages - {"index.md"}
    assert os.path.isfile(ROOT / "docs" / "img" / "timeline.png")
