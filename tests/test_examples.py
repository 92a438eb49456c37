"""The examples and the quickstart notebook run end to end on tiny settings.

Each runs in a child process (its own MXNet, kernel and threads), bounded by a timeout.
"""
from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 240


def run(argv, cwd) -> str:
    out = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert out.returncode == 0, f"{argv} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


QUICKSTART = os.path.join(ROOT, "notebooks", "quickstart.ipynb")


def example(name: str) -> str:
    return os.path.join(ROOT, "examples", name)


def test_timeseries_lstm_trains_two_epochs_on_generated_dates(tmp_path):
    out = run([sys.executable, example("timeseries_lstm.py"), "--tiny"], tmp_path).splitlines()
    epochs = [line for line in out if line.startswith("epoch ") and "windows" in line]
    assert [line.split(":")[0] for line in epochs] == ["epoch 0", "epoch 1"]
    # context_rows: 3 dates x 150 rows - 8 steps windows, one series (16 more than the dates
    # windowed alone); batches of 32 with rollover: 13 full batches, then 14
    assert all("442 windows made (+16 against each date windowed alone)" in line
               for line in epochs)
    assert "416 trained" in epochs[0] and "448 trained" in epochs[1]
    # exact validation (even_batches='pad'): 2 held-out dates x 150 rows - 8 steps windows (one
    # series), each counted once
    assert all("validation MSE" in line and line.endswith("over 292") for line in epochs)
    # provenance: each epoch names its worst window's date (a training date) and row
    worst = [line for line in out if line.startswith("  largest loss")]
    assert len(worst) == 2 and all(re.search(r"date 2024-01-0[123], window (\d+) ", line)
                                   and int(re.search(r"window (\d+)", line)[1]) < 150
                                   for line in worst)
    # epoch 1 reuses the cache (and a date read first as another's context is a hit too)
    assert re.search(r"shards: 6 produced \([34] cache hits\)", out[-1]), out[-1]
    assert os.listdir(tmp_path) == []  # its temporary cache is gone


def test_gluoncv_classification_trains_a_model_zoo_net(tmp_path):
    out = run([sys.executable, example("gluoncv_classification.py"), "--tiny"], tmp_path)
    line = next(x for x in out.splitlines() if x.startswith("epoch 0:"))
    assert "48 images" in line and "train accuracy" in line


def test_d2l_numpy_trains_in_numpy_mode(tmp_path):
    out = run([sys.executable, example("d2l_numpy.py"), "--tiny"], tmp_path).splitlines()
    epochs = [line for line in out if line.startswith("epoch ")]
    assert [line.split(":")[0] for line in epochs] == ["epoch 0", "epoch 1", "epoch 2"]
    assert all("12 of 12 batches" in line for line in epochs)  # len(train_iter) held
    assert out[-1].startswith("batches: mxnet.numpy.ndarray (16, 1, 16, 16)")
    assert float(out[-1].rsplit(" ", 1)[1]) > 0.9


def test_module_fit_trains_scores_and_predicts(tmp_path):
    out = run([sys.executable, example("module_fit.py"), "--tiny", "--prefetching"], tmp_path)
    lines = out.splitlines()
    assert any(x.startswith("validation accuracy: ") for x in lines)
    assert "predictions: (150, 3)" in lines


def notebook_outputs(nb: dict) -> tuple[list[dict], str, str]:
    """A notebook's outputs, their text (streams and text/plain), and the progress bars' text."""
    outputs = [o for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])]
    text = "".join("".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", ""))
                   for o in outputs)
    bars = "\n".join("".join(o["data"].get("text/plain", "")) for o in outputs
                     if "application/vnd.jupyter.widget-view+json" in o.get("data", {}))
    return outputs, text, bars


def check_quickstart_outputs(nb: dict) -> str:
    """What the quickstart must show, executed now or as shipped; returns the outputs' text."""
    outputs, text, bars = notebook_outputs(nb)
    assert not [o for o in outputs if o["output_type"] == "error"]
    assert all(c.get("execution_count") for c in nb["cells"] if c["cell_type"] == "code")
    for epoch in range(3):  # trained 0 and 1, interrupted 2, then a clean epoch 2
        assert f"epoch {epoch}: 11904 samples" in text, epoch
    table = text[text.index("epoch  batches"):]
    assert [line.split()[0] for line in table.splitlines()[1:5]] == ["0", "1", "2*", "2"]
    assert "* a pass that was interrupted" in table  # the footnote explains the 2* row
    assert int(re.search(r"shards: (\d+) produced", table).group(1)) > 3 * 4  # > 1 per epoch
    assert "waiting=" in bars or "waiting=" in text  # widgets, or text bars without ipywidgets
    assert "0batch [00:00, ?batch/s]" not in bars  # a saved widget shows its final figures
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the timeline plot
    return text


def test_quickstart_notebook_executes_without_errors(tmp_path):
    """nbclient runs every cell in a real Jupyter kernel; any error fails the test."""
    executed = tmp_path / "executed.ipynb"
    script = textwrap.dedent("""
        import sys
        import nbformat
        from nbclient import NotebookClient
        nb = nbformat.read(sys.argv[1], as_version=4)
        NotebookClient(nb, timeout=180, kernel_name="python3",
                       resources={"metadata": {"path": sys.argv[2]}}).execute()
        nbformat.write(nb, sys.argv[3])
    """)
    run([sys.executable, "-c", script, QUICKSTART, str(tmp_path), str(executed)], tmp_path)
    check_quickstart_outputs(json.loads(executed.read_text()))


def test_the_shipped_quickstart_shows_the_overlap():
    """The notebook as committed (what a reader sees without running it) shows a real run:
    after each epoch's first batch the loop waited for less than a tenth of the time."""
    with open(QUICKSTART, encoding="utf-8") as fp:
        text = check_quickstart_outputs(json.load(fp))
    waits = re.findall(r"epoch (\d): first batch after [\d.]+ s, then waited [\d.]+ s of "
                       r"[\d.]+ s \((\d+)%\)", text)
    assert [e for e, _ in waits] == ["0", "1", "2"]
    assert all(int(share) < 10 for _, share in waits), waits


def test_resume_training_continues_with_the_batches_an_uninterrupted_run_sees(tmp_path):
    out = run([sys.executable, example("resume_training.py"), "--tiny"], tmp_path).splitlines()
    assert "preempted after 7 batches" in out[0] and "resumed at epoch 0, batch 7" in out
    assert out[-1] == "resumed run = uninterrupted run: the same 50 batches"


EXAMPLES = ["timeseries_lstm.py", "gluoncv_classification.py", "module_fit.py",
            "resume_training.py"]

# Every example's --help in one interpreter (one MXNet import, not one per example): each runs
# as ``python examples/NAME --help`` would run it (argv, sys.path[0], __main__), and exits.
_HELPS = r"""
import contextlib, io, json, os, runpy, sys
out = {}
for path in sys.argv[1:]:
    sys.argv, sys.path[0] = [path, "--help"], os.path.dirname(path)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        try:
            runpy.run_path(path, run_name="__main__")
            code = "it did not exit"
        except SystemExit as exc:
            code = exc.code or 0
    out[os.path.basename(path)] = [code, buf.getvalue()]
sys.stdout.write(json.dumps(out))
"""


@functools.lru_cache(maxsize=None)
def _helps() -> dict:
    names = EXAMPLES + ["estimator_checkpoint.py"]
    return json.loads(run([sys.executable, "-c", _HELPS, *map(example, names)], ROOT))


def help_of(name: str) -> str:
    """What ``python examples/NAME --help`` prints; it must exit with 0."""
    code, out = _helps()[name]
    assert code == 0, f"{name} --help: exit {code}\n{out[-3000:]}"
    return out


@pytest.mark.parametrize("name", EXAMPLES)
def test_examples_have_help_for_every_option_and_tiny(name):
    out = help_of(name)
    options = re.split(r"\n(?:options|optional arguments):\n", out, maxsplit=1)[1]  # 3.10+, 3.9
    blocks = re.split(r"\n(?=  -)", options.strip("\n"))
    helps = {b.split()[0].rstrip(","): re.match(r"\s*(-.*?)(\s{2,}|$)(.*)",
                                                 b.replace("\n", "  "), re.S).group(3).strip()
             for b in blocks}
    assert "--tiny" in helps and all(helps.values()), helps


def test_gluoncv_example_without_gluoncv_has_help_and_names_the_extra(tmp_path):
    def start_blocked(*argv):
        code = ("import runpy, sys; sys.modules['gluoncv'] = None; "
                f"sys.argv = [{example('gluoncv_classification.py')!r}, *{list(argv)!r}]; "
                "runpy.run_path(sys.argv[0], run_name='__main__')")
        return subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def finished(proc):
        out, err = proc.communicate(timeout=TIMEOUT_S)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    started = [start_blocked("--help"), start_blocked("--tiny")]  # side by side: one wait
    try:
        helped, refused = map(finished, started)
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert helped.returncode == 0 and "--tiny" in helped.stdout, helped.stderr[-2000:]
    assert refused.returncode == 1
    assert refused.stderr.strip().endswith("pip install 'gluon_stream[examples]'"), refused.stderr
