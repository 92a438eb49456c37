"""The gluon-stream CLI: subcommands succeed, and fail with exit status 2 and one clear line."""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from gluon_stream.cli import build_parser, expand_keys, main
from gluon_stream.tools import generator

GEN = shlex.join(generator.generator_command(rows=50, num_inputs=3))

pytestmark = pytest.mark.usefixtures("warm_matplotlib")


def one_error_line(err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "error:" in lines[0] and all(n in lines[0] for n in needles), lines[0]


def subcommands() -> list[str]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(action.choices)


def test_help_on_every_subcommand(capsys):
    names = subcommands()
    assert {"demo", "inspect", "generate"} <= set(names)
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: gluon-stream") and all(name in out for name in names)
    for name in names:
        assert main([name, "--help"]) == 0, name
        assert capsys.readouterr().out.startswith(f"usage: gluon-stream {name}"), name


def test_python_m_gluon_stream_help():
    out = subprocess.run([sys.executable, "-m", "gluon_stream", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "inspect" in out.stdout, out.stderr


def test_light_commands_never_import_mxnet_or_matplotlib(tmp_path):
    """--help, --version, inspect and generate start in well under a second: MXNet (2-3 s to
    import) and matplotlib are left for demo and bench."""
    np.save(tmp_path / "a.npy", np.zeros((3, 2), np.float32))
    runs = [["--help"], ["--version"], ["inspect", str(tmp_path / "a.npy")],
            ["generate", "--help"],
            ["generate", "--command", GEN, "--keys", "k", "--cache-dir", str(tmp_path / "c"),
             "--no-progress"]]
    code = textwrap.dedent(f"""
        import sys
        from gluon_stream.cli import main
        for argv in {runs!r}:
            assert main(argv) == 0, argv
            heavy = sorted({{"mxnet", "matplotlib"}} & set(sys.modules))
            assert not heavy, (argv, heavy)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "c" / "k.npy").exists()


def help_blocks(text: str) -> dict[str, str]:
    """An option's help text from argparse's output, by its first option string."""
    blocks: dict[str, str] = {}
    name = None
    for line in re.split(r"\n(?:options|optional arguments):\n", text, maxsplit=1)[1].splitlines():
        if line.startswith("  -"):
            name = line.split()[0].rstrip(",")
            blocks[name] = line
        elif name is not None and line.startswith("   "):
            blocks[name] += " " + line.strip()
    return blocks


@pytest.mark.parametrize("name", subcommands())
def test_help_is_plain_text_and_every_option_says_what_and_its_default(name):
    parser = next(a for a in build_parser()._actions
                  if isinstance(a, argparse._SubParsersAction)).choices[name]
    text = parser.format_help()
    for markup in ("``", ":class:", ":mod:", ":func:", "::\n"):
        assert markup not in text, (name, markup)
    blocks = help_blocks(text)
    one_required = {a for g in parser._mutually_exclusive_groups if g.required
                    for a in g._group_actions}  # --keys or --keys-file
    for action in parser._actions:
        if not action.option_strings or action.option_strings[0] == "-h":
            continue
        block = blocks[action.option_strings[0]]
        assert action.help, (name, action.option_strings)
        if action.nargs != 0 and not action.required and action not in one_required:
            assert "default" in block, (name, block)


def test_unknown_subcommand_and_missing_arguments_exit_2(capsys):
    assert main(["nope"]) == 2
    one_error_line(capsys.readouterr().err, "invalid choice", "nope")
    assert main([]) == 2
    one_error_line(capsys.readouterr().err, "COMMAND")


# -- inspect --------------------------------------------------------------------------------
@pytest.fixture
def shard_dir(tmp_path):
    np.save(tmp_path / "2024-01-01.npy", np.zeros((5, 3), np.float32))
    np.savez(tmp_path / "2024-01-02.npz", x=np.zeros((4, 2, 2), np.float64),
             y=np.arange(4, dtype=np.int64))
    (tmp_path / "broken.npy").write_bytes(np.lib.format.magic(1, 0) + b"\x10\x00{'descr'")
    (tmp_path / "notes.txt").write_text("not a shard")
    return tmp_path


def test_inspect_lists_arrays_and_flags_unreadable_files(shard_dir, capsys):
    assert main(["inspect", str(shard_dir)]) == 1  # one unreadable file
    out = capsys.readouterr().out.splitlines()
    rows = {tuple(line.split()[:2]): line.split() for line in out[1:-1]}
    assert rows[("2024-01-01", "arr_0")][2:6] == ["(5,", "3)", "float32", "60"]
    assert rows[("2024-01-02", "x")][2:7] == ["(4,", "2,", "2)", "float64", "128"]
    assert rows[("2024-01-02", "y")][2:4] == ["(4,)", "int64"]
    assert rows[("broken", "UNREADABLE:")]
    assert "truncated" in " ".join(rows[("broken", "UNREADABLE:")])
    assert out[-1] == "3 files, 2 readable, 1 unreadable"
    assert not any("notes" in line for line in out)


def test_inspect_glob_of_good_files_succeeds(shard_dir, capsys):
    assert main(["inspect", str(shard_dir / "2024-*")]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "2 files, 2 readable, 0 unreadable"


def test_inspect_works_without_mxnet(shard_dir):
    code = ("import sys; sys.modules['mxnet'] = None\n"
            "from gluon_stream.cli import main\n"
            f"raise SystemExit(main(['inspect', {str(shard_dir / '2024-01-01.npy')!r}]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "(5, 3)" in out.stdout


def test_inspect_bad_paths_exit_2(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "missing.npy")]) == 2
    one_error_line(capsys.readouterr().err, "no such file", "missing.npy")
    assert main(["inspect", str(tmp_path / "*.npy")]) == 2
    one_error_line(capsys.readouterr().err, "no shard files match")
    assert main(["inspect"]) == 2
    one_error_line(capsys.readouterr().err, "PATH_OR_GLOB")


# -- generate -------------------------------------------------------------------------------
def test_generate_fills_the_cache_in_parallel_then_skips_cached_keys(tmp_path, capsys):
    cache = tmp_path / "cache"
    argv = ["generate", "--command", GEN, "--keys", "2024-02-28..2024-03-01", "x1",
            "--cache-dir", str(cache), "--jobs", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "4/4 shards" in out and "(4 generated, 0 already cached, 0 failed)" in out
    assert sorted(os.listdir(cache)) == [".gluon_stream-sizes.json", "2024-02-28.npy",
                                         "2024-02-29.npy", "2024-03-01.npy", "x1.npy"]
    recorded = json.loads((cache / ".gluon_stream-sizes.json").read_text())["shards"]
    assert {name: entry["samples"] for name, entry in recorded.items()} == {
        "2024-02-28": 50, "2024-02-29": 50, "2024-03-01": 50, "x1": 50}
    np.testing.assert_array_equal(np.load(cache / "x1.npy"), generator.generate("x1", 50, 3))
    assert main(argv) == 0
    assert "(0 generated, 4 already cached, 0 failed)" in capsys.readouterr().out


def test_generate_reports_failed_keys_with_exit_1(tmp_path, capsys):
    keys = tmp_path / "keys.txt"
    keys.write_text("a\n\nb\n")
    fail = shlex.join([sys.executable, "-c", "import sys; sys.exit('boom')", "{path}"])
    assert main(["generate", "--command", fail, "--keys-file", str(keys), "--cache-dir",
                 str(tmp_path / "c"), "--retries", "0", "--no-progress"]) == 1
    captured = capsys.readouterr()
    assert "(0 generated, 0 already cached, 2 failed)" in captured.out
    failed = [line for line in captured.err.splitlines() if line.startswith("failed: ")]
    assert sorted(line.split()[1] for line in failed) == ["a:", "b:"]
    assert all("exit code 1" in line for line in failed)
    assert captured.err.count("    boom") == 2  # each key's stderr tail, under its line


def test_generate_failures_name_cli_flags_and_keep_the_stderr_tail(tmp_path, capsys):
    fail = shlex.join([sys.executable, "-c",
                       "import sys; print('first'); sys.exit('no licence for {key}')", "{path}"])
    slow = shlex.join([sys.executable, "-c",
                       "import sys, time; print('working', file=sys.stderr, flush=True); "
                       "time.sleep(30)", "{path}"])
    assert main(["generate", "--command", fail, "--keys", "a", "--cache-dir",
                 str(tmp_path / "c"), "--retries", "1", "--no-progress"]) == 1
    assert main(["generate", "--command", slow, "--keys", "b", "--cache-dir",
                 str(tmp_path / "c"), "--retries", "0", "--timeout", "0.5",
                 "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "retries=" not in err and "timeout=" not in err, err
    lines = err.splitlines()
    retried = lines.index(next(x for x in lines if x.startswith("failed: a:")))
    assert "gave up after 2 attempts; --retries sets how many" in lines[retried]
    assert lines[retried + 1] == "    no licence for a"
    timed_out = next(x for x in lines if x.startswith("failed: b:"))
    assert "--timeout 0.5" in timed_out and "raise --timeout" in timed_out
    assert "    working" in lines


@pytest.mark.parametrize("extra, needles", [
    (["--keys", "a"], ["--cache-dir"]),
    (["--cache-dir", "c"], ["--keys"]),
    (["--keys", "a", "--cache-dir", "c", "--jobs", "0"], ["--jobs", "positive integer"]),
    (["--keys", "2024-01-05..2024-01-01", "--cache-dir", "c"], ["empty"]),
    (["--keys", "2024-01-01..soon", "--cache-dir", "c"], ["ISO dates"]),
    (["--keys", "../etc", "--cache-dir", "c"], ["not allowed"]),
    (["--keys", "-3..3", "--cache-dir", "c"], ["--keys", "'-3..3'", "--keys=-3..3"]),
    (["--keys=-3..3", "--cache-dir", "c"], ["'-3..3'", "may not start with '-'"]),
    (["--keys", "a", "--cache-dir", "c", "--epoch", "-1"], ["--epoch", ">= 0"]),
    (["--keys", "a", "--cache-dir", "c", "--retries", "-1"], ["--retries", ">= 0"]),
    (["--keys", "a", "--cache-dir", "c", "--timeout", "inf"], ["--timeout", "finite"]),
    (["--keys", "a", "--cache-dir", "file"], ["--cache-dir", "is a file"]),
    (["--keys", "a", "--cache-dir", "file/sub"], ["--cache-dir", "cannot create"]),
])
def test_generate_bad_arguments_exit_2_in_one_line(extra, needles, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("not a directory")
    assert main(["generate", "--command", GEN] + extra) == 2
    one_error_line(capsys.readouterr().err, *needles)
    assert not os.path.exists(tmp_path / "c") or not os.listdir(tmp_path / "c")


def test_generate_command_without_path_placeholder_exit_2(tmp_path, capsys):
    assert main(["generate", "--command", "gen --date {key}", "--keys", "a",
                 "--cache-dir", str(tmp_path)]) == 2
    one_error_line(capsys.readouterr().err, "{path}")


def test_expand_keys_ranges():
    assert expand_keys(["3..5", "2023-12-31..2024-01-01"]) == ["3", "4", "5", "2023-12-31",
                                                               "2024-01-01"]


# -- demo -----------------------------------------------------------------------------------
@pytest.mark.mxnet
def test_demo_trains_prints_a_table_and_writes_the_timeline(tmp_path, capsys):
    png, trace = tmp_path / "timeline.png", tmp_path / "trace.json"
    assert main(["demo", "--shards", "3", "--rows", "120", "--inputs", "3", "--time-steps", "4",
                 "--delay", "0", "--batch-size", "32", "--plot", str(png),
                 "--trace", str(trace)]) == 0
    captured = capsys.readouterr()
    out = captured.out.splitlines()
    assert [line.split(":")[0] for line in out if line.startswith("epoch ") and ":" in line] == [
        "epoch 0", "epoch 1"]
    header = next(i for i, line in enumerate(out) if line.split()[:2] == ["epoch", "batches"])
    assert [line.split()[0] for line in out[header + 1:header + 3]] == ["0", "1"]
    assert out[-1] == f"timeline: {png}"
    assert f"chrome trace: {trace}" in out
    assert png.read_bytes()[:4] == b"\x89PNG" and trace.stat().st_size > 0
    assert "epoch 0" in captured.err and "waiting=" in captured.err  # the progress bars


@pytest.mark.parametrize("extra, needles", [
    (["--shards", "0"], ["--shards", "positive integer"]),
    (["--delay", "-1"], ["--delay"]),
    (["--delay", "inf"], ["--delay", "finite"]),
    (["--prefetch", "-1"], ["--prefetch"]),
    (["--plot", "/nonexistent/dir/x.png"], ["--plot", "does not exist"]),
    (["--plot", "x.txt"], ["--plot", ".txt", ".png"]),
    (["--plot", "."], ["--plot", "directory"]),
    (["--trace", "/nonexistent/dir/t.json"], ["--trace", "does not exist"]),
    (["--cache-dir", "file"], ["--cache-dir", "is a file"]),
    (["--cache-dir", "file/sub"], ["--cache-dir", "cannot create"]),
    (["--rows", "100", "--time-steps", "100"], ["--time-steps", "--rows"]),
    (["--time-steps", "5000"], ["--time-steps", "--rows"]),
    (["--shards", "1", "--rows", "20", "--time-steps", "16"], ["--batch-size", "4 windows"]),
])
def test_demo_refuses_bad_arguments_before_any_work(extra, needles, tmp_path, capsys,
                                                    monkeypatch):
    from gluon_stream.cli import demo

    def no_work(*args, **kwargs):
        raise AssertionError("the demo started working before checking its arguments")

    monkeypatch.setattr(demo, "import_mxnet", no_work)
    monkeypatch.setattr(demo, "CommandSource", no_work)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("not a directory")
    assert main(["demo"] + extra) == 2
    one_error_line(capsys.readouterr().err, *needles)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into a read-only-mode directory")
def test_demo_refuses_an_unwritable_cache_dir(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    assert main(["demo", "--cache-dir", str(locked / "shards")]) == 2
    one_error_line(capsys.readouterr().err, "--cache-dir", "cannot create")
    assert main(["demo", "--cache-dir", str(locked)]) == 2
    one_error_line(capsys.readouterr().err, "--cache-dir", "cannot write")


def test_bench_lists_each_known_contender_once(capsys):
    from gluon_stream.tools import bench

    assert main(["bench", "--contenders", "naive,warp"]) == 2
    err = capsys.readouterr().err
    one_error_line(err, "--contenders", "'warp'")
    listed = err.strip().split("choose from ")[1].split(", ")
    assert sorted(listed) == sorted(set(bench.PIPELINE_CONTENDERS + bench.THROUGHPUT_CONTENDERS
                                        + bench.PERSAMPLE_CONTENDERS))
