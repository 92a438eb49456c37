"""A deliberately misbehaving shard generator for the robustness tests (run as a real process).

    python fake_generator.py --mode MODE --key KEY --out PATH [--rows N] [--cols N]
                             [--count FILE] [--pids FILE] [--started FILE] [--gate FILE]
                             [--modes JSON]

Modes (``--modes '{"KEY": "MODE"}'`` picks a mode per key, ``--mode`` is the default):

ok            a valid (rows, cols) float32 array whose values encode the key
exit-nonzero  writes to stderr, exits 3
hang          never finishes (sleeps until killed)
grandchild    starts a grandchild that sleeps forever, writes a valid shard, exits 0
grandchild-hang  starts a grandchild that sleeps forever, then hangs itself
no-file       exits 0 without writing anything
truncated     a valid .npy cut in half
garbage       random bytes
pickle        a pickle whose ``__reduce__`` would create ``PATH.marker`` when unpickled
object        an object-dtype .npy (holds a pickle)
junk          a valid .npy with bytes appended
forged        a header claiming ~80 GB followed by 16 bytes of data
wrong-dtype   a valid float64 array instead of float32
empty         a 0-byte file
zero-rows     a valid (0, cols) float32 array
slow          writes the first half, touches ``--started``, waits for ``--gate``, writes the rest
enospc        writes part of the shard, then hits a real ENOSPC (writes to /dev/full), exits 1
stderr-flood  writes 50 MB to stderr, then exits 4
symlink       makes PATH a symlink to ``PATH.outside.npy`` (a valid shard it writes there)
directory     makes a directory at PATH (with a file in it), exits 0
fifo          makes a FIFO at PATH, exits 0 (opening it for reading would block)
np-savez      ``np.savez(PATH, ...)``: numpy appends ``.npz`` to a PATH ending in ``.npy``
np-save       ``np.save(PATH, ...)``: numpy appends ``.npy`` to a PATH ending in ``.npz``
short-write   fails as numpy does on a full disk: "OSError: N requested and M written", exit 1
delete-cache-once  the first run deletes the cache directory (PATH's folder) and exits 0
                   (marker ``cache-deleted`` beside it); later runs are ``ok``

Every run appends one line to ``--count`` (how many times the generator ran) and, with
``--pids``, the pids of itself (and of its grandchild) to that file. ``--started`` is touched
once the run has begun; ``--gate`` makes it wait for that file before writing.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import time
import zlib

import numpy as np

GATE_POLL_S = 0.02


class _Marker:
    """Unpickling this calls ``open(path, 'w')``: proof that someone ran pickle on the shard."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def shard_values(key: str, rows: int, cols: int, dtype: str = "float32") -> np.ndarray:
    """The array an ``ok`` run writes for ``key``: rows of ``crc32(key) * 1000 + row``."""
    base = float(zlib.crc32(key.encode("utf-8")) % 100_000) * 1000.0
    arr = base + np.arange(rows, dtype=np.float64)[:, None] + np.zeros((1, cols))
    return arr.astype(dtype)


def _npy_bytes(arr: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    np.lib.format.write_array(buf, arr, allow_pickle=False)
    return buf.getvalue()


def _append(path: str | None, text: str) -> None:
    if path:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, text.encode() + b"\n")
        finally:
            os.close(fd)


def _wait_for(path: str | None) -> None:
    while path and not os.path.exists(path):
        time.sleep(GATE_POLL_S)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="ok")
    parser.add_argument("--modes", default="{}", help="JSON object: key -> mode")
    parser.add_argument("--key", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", type=int, default=10)
    parser.add_argument("--cols", type=int, default=3)
    parser.add_argument("--count")
    parser.add_argument("--pids")
    parser.add_argument("--started")
    parser.add_argument("--gate")
    parser.add_argument("--groups", help="append 'pid pgid sid' of this run to this file")
    args = parser.parse_args(argv)
    mode = json.loads(args.modes).get(args.key, args.mode)
    _append(args.count, f"{args.key} {mode} {os.getpid()}")
    _append(args.pids, str(os.getpid()))
    _append(args.groups, f"{os.getpid()} {os.getpgid(0)} {os.getsid(0)}")
    if mode != "slow" and args.started:
        _append(args.started, args.key)
    if mode != "slow":
        _wait_for(args.gate)
    good = _npy_bytes(shard_values(args.key, args.rows, args.cols))

    if mode == "ok":
        payload = good
    elif mode == "exit-nonzero":
        sys.stderr.write("fake_generator: warming up\n" * 5)
        sys.stderr.write(f"fake_generator: cannot produce {args.key}: upstream data missing\n")
        return 3
    elif mode == "hang":
        while True:
            time.sleep(60)
    elif mode in ("grandchild", "grandchild-hang"):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                 stdin=subprocess.DEVNULL)
        _append(args.pids, str(child.pid))
        if args.started:
            _append(args.started, "grandchild")
        while mode == "grandchild-hang":
            time.sleep(60)
        payload = good
    elif mode == "no-file":
        return 0
    elif mode == "truncated":
        payload = good[: len(good) // 2]
    elif mode == "garbage":
        payload = np.random.default_rng(0).bytes(500)
    elif mode == "pickle":
        payload = pickle.dumps(_Marker(args.out + ".marker"), protocol=2)
    elif mode == "object":
        import io

        buf = io.BytesIO()
        np.save(buf, np.array([_Marker(args.out + ".marker"), 1], dtype=object), allow_pickle=True)
        payload = buf.getvalue()
    elif mode == "junk":
        payload = good + b"JUNK" * 64
    elif mode == "forged":
        header = {"descr": "<f8", "fortran_order": False, "shape": (100_000, 100_000)}
        import io

        buf = io.BytesIO()
        np.lib.format.write_array_header_1_0(buf, header)
        payload = buf.getvalue() + b"\x00" * 16
    elif mode == "wrong-dtype":
        payload = _npy_bytes(shard_values(args.key, args.rows, args.cols, "float64"))
    elif mode == "empty":
        payload = b""
    elif mode == "zero-rows":
        payload = _npy_bytes(np.zeros((0, args.cols), np.float32))
    elif mode == "slow":
        with open(args.out, "wb") as fp:
            fp.write(good[: len(good) // 2])
            fp.flush()
            _append(args.started, args.key)
            _wait_for(args.gate)
            fp.write(good[len(good) // 2:])
        return 0
    elif mode == "enospc":
        with open(args.out, "wb") as fp:
            fp.write(good[: len(good) // 2])
        with open("/dev/full", "wb") as full:
            full.write(good)
            full.flush()  # raises OSError(ENOSPC): "No space left on device"
        return 0
    elif mode == "stderr-flood":
        chunk = "x" * 1023 + "\n"
        for _ in range(50 * 1024):
            sys.stderr.write(chunk)
        sys.stderr.write("fake_generator: flood done\n")
        return 4
    elif mode == "directory":
        os.mkdir(args.out)
        with open(os.path.join(args.out, "inside.npy"), "wb") as fp:
            fp.write(good)
        return 0
    elif mode == "fifo":
        os.mkfifo(args.out)
        return 0
    elif mode == "np-savez":
        np.savez(args.out, x=shard_values(args.key, args.rows, args.cols))
        return 0
    elif mode == "np-save":
        np.save(args.out, shard_values(args.key, args.rows, args.cols))
        return 0
    elif mode == "short-write":
        sys.stderr.write("Traceback (most recent call last):\n  File \"gen.py\", line 9, in "
                         "<module>\n    np.save(out, arr)\nOSError: 8192 requested and 0 "
                         "written\n")
        return 1
    elif mode == "delete-cache-once":
        cache = os.path.dirname(os.path.abspath(args.out))
        marker = os.path.join(os.path.dirname(cache), "cache-deleted")
        if not os.path.exists(marker):
            open(marker, "w").close()
            import shutil

            shutil.rmtree(cache)
            return 0
        payload = good
    elif mode == "symlink":
        outside = args.out + ".outside.npy"
        with open(outside, "wb") as fp:
            fp.write(good)
        os.symlink(outside, args.out)
        return 0
    else:
        sys.stderr.write(f"fake_generator: unknown mode {mode!r}\n")
        return 2
    with open(args.out, "wb") as fp:
        fp.write(payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def command(mode: str = "ok", *, workdir=None, modes: dict | None = None, rows: int = 10,
            cols: int = 3, gate: bool = False) -> list[str]:
    """argv for a CommandSource; with ``workdir``, runs are counted in ``workdir/count``,
    pids logged in ``workdir/pids``, ``workdir/started`` touched, and with ``gate`` each run
    waits for ``workdir/gate``."""
    argv = [sys.executable, os.path.abspath(__file__), "--mode", mode, "--key", "{key}",
            "--out", "{path}", "--rows", str(rows), "--cols", str(cols)]
    if modes:
        argv += ["--modes", json.dumps(modes)]
    if workdir is not None:
        workdir = os.fspath(workdir)
        argv += ["--count", os.path.join(workdir, "count"), "--pids",
                 os.path.join(workdir, "pids"), "--started", os.path.join(workdir, "started")]
        if gate:
            argv += ["--gate", os.path.join(workdir, "gate")]
    return argv


def read_lines(path) -> list[str]:
    """Lines of a count/pids/started file (empty if it does not exist yet)."""
    try:
        with open(path) as fp:
            return [line for line in fp.read().splitlines() if line]
    except FileNotFoundError:
        return []


def hidden_files(directory) -> list[str]:
    """Temp and lock files (dot files) left in a cache directory."""
    return sorted(n for n in os.listdir(directory) if n.startswith("."))


def command_source(tmp_path, mode="ok", keys=("k1",), **kw):
    """A CommandSource over this generator in ``mode``, runs counted in ``tmp_path``."""
    import gluon_stream as gs

    kw.setdefault("retries", 0)
    kw.setdefault("backoff", 0.01)
    kw.setdefault("timeout", 20)
    gate = kw.pop("gate", False)
    modes = kw.pop("modes", None)
    rows = kw.pop("rows", 10)
    return gs.CommandSource(list(keys), command(mode, workdir=tmp_path, modes=modes, gate=gate,
                                                rows=rows),
                            cache_dir=tmp_path / "cache", **kw)


def generator_runs(tmp_path) -> list[str]:
    """One line per generator run so far."""
    return read_lines(tmp_path / "count")
