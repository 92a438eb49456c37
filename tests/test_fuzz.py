"""The bad-file contract, fuzzed: every file yields arrays identical to ``np.load(path,
allow_pickle=False)`` or raises a ``gs.StreamError`` -- never another exception, never a
silently different result, never a hang.

A seeded mutator (no hypothesis database, the same files on every run) starts from valid
``.npy``/``.npz`` files of many dtypes and shapes and damages them the ways real files get
damaged and forged: flipped bytes, edited header fields (dtype, shape, order, length, version),
header text cut or salted with brackets and quotes, truncation, junk, and zip tricks (the
encryption flag, other compression methods, a damaged bz2 member, CRC, duplicate or odd member
names). Each file goes through ``load_shard``, ``inspect_shard``, ``FileSource`` and a
``CommandSource`` cache, both as a generator's output and as a damaged file already cached.

Run ``python tests/test_fuzz.py 3000`` to print the outcome counts for more files.
"""
from __future__ import annotations

import collections
import io
import math
import os
import random
import struct
import sys
import warnings
import zipfile
from typing import Any, Callable

import numpy as np
import pytest

import gluon_stream as gs

MAGIC = b"\x93NUMPY"


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, arr, allow_pickle=False)
    return buf.getvalue()


def _bases() -> dict[str, np.ndarray]:
    """Valid arrays of every dtype family numpy can store without pickle."""
    return {
        "f32": np.arange(15, dtype=np.float32).reshape(5, 3),
        "i64": np.arange(7, dtype=np.int64),
        "bool": np.array([True, False, True]),
        "u16": np.arange(6, dtype=np.uint16),
        "f16": np.linspace(0, 1, 4, dtype=np.float16),
        "big-endian": np.arange(4, dtype=">f8"),
        "fortran": np.asfortranarray(np.arange(12.0).reshape(4, 3)),
        "rows0": np.zeros((0, 3), np.float32),
        "trail0": np.zeros((4, 0), np.float32),
        "scalar": np.array(3.0),
        "datetime": np.array(["2024-01-01", "2024-01-02"], dtype="datetime64[D]"),
        "complex": np.arange(3) * 1j,
        "str": np.array(["ab", "c"]),
        "bytes": np.array([b"ab", b"c"]),
        "record": np.zeros(3, dtype=[("a", "<i4"), ("b", "<f8")]),
        "void": np.zeros(3, dtype="V4"),
    }


DESCRS = ["'<f4'", "'<f8'", "'|b1'", "'<u2'", "'<M8[D]'", "'<m8[s]'", "'<c16'", "'<U3'",
          "'|S0'", "'|V0'", "'<U0'", "'|S2'", "'|O'", "'>i8'", "'<f16'", "'<i0'", "'bogus'",
          "'<M8[bogus]'", "[('a', '<i4'), ('b', '<f8')]", "[('a', '|V0')]", "[('', '<i4')]",
          "[('a', '<i4', (0,))]", "[('a', '<i4', (1099511627776,))]", "[('a', '|O')]",
          "('<i4', (2,))", "[('a', '<i4'), ('a', '<f8')]", "[]", "None", "3", "'<f4", "{}"]
SHAPES = ["()", "(0,)", "(5,)", "(5, 3)", "(3, 5)", "(15,)", "(1099511627776,)",
          "(9223372036854775808,)", "(18446744073709551616,)", "(-1,)", "(1000000000000, 0)",
          "(0, 1000000000000)", "(2147483648, 2147483648, 2147483648)", "(5, 0)", "(5, 3.0)",
          "[5, 3]", "(True,)", "5", "(5,", "(5, 3))"]
ORDERS = ["False", "True", "0", "'no'", "None"]
SALT = "(){}[]'\",:\n\\ 0123456789#"


def _header(descr: str, fortran: str, shape: str, version: int = 1) -> bytes:
    text = "{'descr': %s, 'fortran_order': %s, 'shape': %s, }" % (descr, fortran, shape)
    prefix = 10 if version == 1 else 12
    pad = -(prefix + len(text) + 1) % 64
    raw = (text + " " * pad + "\n").encode("latin1")
    length = struct.pack("<H" if version == 1 else "<I", len(raw))
    return MAGIC + bytes([version, 0]) + length + raw


def _expected_data_bytes(descr: str, shape: str) -> int | None:
    """Data size the header claims, if numpy could parse it (None otherwise)."""
    try:
        dims = eval(shape, {"__builtins__": {}})  # noqa: S307 - our own literal pool
        dtype = np.lib.format.descr_to_dtype(eval(descr, {"__builtins__": {}}))  # noqa: S307
        size = math.prod(dims) * dtype.itemsize
    except Exception:  # unparsable pool entries: the file keeps its old data
        return None
    return size if isinstance(size, int) else None


def _mutate_npy(rng: random.Random, data: bytes) -> bytes:
    kind = rng.choice(["flip", "flip", "header", "header", "header", "text", "length",
                       "version", "cut", "junk"])
    if kind == "flip":
        buf = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            at = (rng.randrange(min(len(buf), 128)) if rng.random() < 0.7
                  else rng.randrange(len(buf)))
            buf[at] ^= rng.randint(1, 255)
        return bytes(buf)
    if kind == "header":
        descr, fortran, shape = rng.choice(DESCRS), rng.choice(ORDERS), rng.choice(SHAPES)
        if rng.random() < 0.5:
            fortran = "False"
        version = rng.choice([1, 1, 2, 3])
        header = _header(descr, fortran, shape, version)
        body = data[_header_end(data):]
        want = _expected_data_bytes(descr, shape)
        if want is not None and want <= 1 << 16 and rng.random() < 0.8:
            body = (body * (want // max(len(body), 1) + 1))[:want] if body else b"\x00" * want
        return header + body
    if kind == "text":
        end = _header_end(data)
        text = bytearray(data[10:end])
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(text))
            if rng.random() < 0.5:
                text[at] = ord(rng.choice(SALT))
            else:
                del text[at]
                text.insert(rng.randrange(len(text)), ord(rng.choice(SALT)))
        return data[:10] + bytes(text) + data[end:]
    if kind == "length":
        buf = bytearray(data)
        struct.pack_into("<H", buf, 8, rng.choice([0, 1, 16, len(data), 65535,
                                                   rng.randrange(256)]))
        return bytes(buf)
    if kind == "version":
        buf = bytearray(data)
        buf[6], buf[7] = rng.choice([(0, 0), (2, 0), (3, 0), (4, 0), (1, 1), (255, 0)])
        return bytes(buf)
    if kind == "cut":
        return data[:rng.randrange(len(data))]
    return data + bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))


def _header_end(data: bytes) -> int:
    return 10 + struct.unpack_from("<H", data, 8)[0]


def _zip(members: list[tuple[str, bytes, int]]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # duplicate member names are one of the tricks
        for name, payload, method in members:
            zf.writestr(zipfile.ZipInfo(name), payload, compress_type=method)
    return buf.getvalue()


def _mutate_npz(rng: random.Random, bases: dict[str, np.ndarray]) -> bytes:
    x, y = bases["f32"], np.arange(5, dtype=np.int64)
    method = rng.choice([zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2,
                         zipfile.ZIP_LZMA])
    members = [("x.npy", _npy(x), method), ("y.npy", _npy(y), method)]
    kind = rng.choice(["member", "member", "member", "lengths", "scalar", "names", "flip",
                       "encrypted", "method", "bz2", "crc", "cut", "junk", "savez"])
    if kind == "savez":
        buf = io.BytesIO()
        (np.savez_compressed if rng.random() < 0.5 else np.savez)(buf, x=x, y=y)
        return _mutate_npy_in_zip(rng, buf.getvalue())
    if kind == "member":
        i = rng.randrange(2)
        members[i] = (members[i][0], _mutate_npy(rng, members[i][1]), method)
        return _zip(members)
    if kind == "lengths":
        members[1] = ("y.npy", _npy(np.arange(rng.choice([0, 3, 7, 10]))), method)
        return _zip(members)
    if kind == "scalar":
        members[rng.randrange(2)] = (rng.choice(["x.npy", "y.npy"]), _npy(np.array(1.5)), method)
        return _zip(members)
    if kind == "names":
        name = rng.choice(["x.npy", "notes.txt", "dir/z.npy", "x", ".npy", "../up.npy"])
        members[1] = (name, members[1][1], method)
        return _zip(members)
    data = bytearray(_zip(members))
    if kind == "flip":
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(len(data))] ^= rng.randint(1, 255)
    elif kind in ("encrypted", "method", "crc"):
        field = {"encrypted": (6, 8), "method": (8, 10), "crc": (14, 16)}[kind]
        value = {"encrypted": 1, "method": rng.choice([0, 8, 12, 14, 99]),
                 "crc": rng.randrange(1 << 16)}[kind]
        for sig, offset in ((b"PK\x03\x04", field[0]), (b"PK\x01\x02", field[1])):
            at = data.find(sig)
            if at >= 0 and rng.random() < 0.8:
                struct.pack_into("<H", data, at + offset, value)
    elif kind == "bz2":
        data = bytearray(_zip([("x.npy", _npy(x), zipfile.ZIP_BZIP2),
                               ("y.npy", _npy(y), zipfile.ZIP_BZIP2)]))
        start = data.find(b"BZh")
        for _ in range(rng.randint(1, 4)):
            data[start + rng.randrange(4, 60)] ^= rng.randint(1, 255)
    elif kind == "cut":
        data = data[:rng.randrange(len(data))]
    else:
        data += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    return bytes(data)


def _mutate_npy_in_zip(rng: random.Random, data: bytes) -> bytes:
    """Flip a byte inside the first member's stored bytes (the header, usually)."""
    buf = bytearray(data)
    start = buf.find(MAGIC)
    if start < 0:  # compressed: damage the deflate stream instead
        start = 60
    buf[min(len(buf) - 1, start + rng.randrange(80))] ^= rng.randint(1, 255)
    return bytes(buf)


def corpus(directory: str, n: int, seed: int = 0) -> list[tuple[str, bytes]]:
    """``n`` files (key, original bytes) written to ``directory`` as ``<key>.bin``."""
    rng = random.Random(seed)
    bases = _bases()
    names = sorted(bases)
    out = []
    for i in range(n):
        if rng.random() < 0.65:
            original = _npy(bases[rng.choice(names)])
            data = original if rng.random() < 0.05 else _mutate_npy(rng, original)
        else:
            original = _zip([("x.npy", _npy(bases["f32"]), zipfile.ZIP_STORED),
                             ("y.npy", _npy(np.arange(5)), zipfile.ZIP_STORED)])
            data = _mutate_npz(rng, bases)
        key = f"f{i:05d}"
        with open(os.path.join(directory, key + ".bin"), "wb") as fp:
            fp.write(data)
        out.append((key, original))
    return out


# -- the contract ---------------------------------------------------------------------------

def _reference(path: str) -> tuple[np.ndarray, ...]:
    """What numpy itself reads (called only once gluon_stream accepted the file)."""
    loaded = np.load(path, allow_pickle=False)
    if isinstance(loaded, np.lib.npyio.NpzFile):
        with loaded:
            return tuple(loaded[name] for name in loaded.files)
    return (loaded,)


def _same(got: tuple, want: tuple) -> bool:
    return len(got) == len(want) and all(
        a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
        for a, b in zip(got, want))


def _a_shard(arrays: tuple) -> bool:
    """Arrays that can be batched together: each has a sample axis, all of the same length."""
    return all(a.ndim >= 1 for a in arrays) and len({a.shape[0] for a in arrays}) <= 1


def judge(call: Callable[[], Any], path: str, *, infos: bool = False) -> str:
    """'typed', 'identical', 'untyped:<Exception>' or 'wrong:<why>' for one call on one file."""
    try:
        got = call()
    except gs.StreamError:
        return "typed"
    except Exception as exc:  # the point of the fuzz: count what escapes untyped
        return f"untyped:{type(exc).__name__}"
    if infos:
        try:
            got_arrays = gs.load_shard(path)
        except gs.StreamError:
            return "wrong:inspect accepts what load refuses"
        except Exception as exc:  # counted in the load_shard column too
            return f"untyped:{type(exc).__name__}"
        if [(i.shape, i.dtype) for i in got] != [(a.shape, a.dtype) for a in got_arrays]:
            return "wrong:inspect describes other arrays"
        got = got_arrays
    try:
        want = _reference(path)
    except Exception:  # numpy refuses what gluon_stream accepted
        return "wrong:np.load refuses it"
    if not _same(tuple(got), want):
        return "wrong:differs from np.load"
    if not _a_shard(tuple(got)):
        return "wrong:not a shard (0-d or arrays of different lengths)"
    return "identical"


def _paths(directory: str, files: list) -> dict[str, str]:
    return {key: os.path.join(directory, key + ".bin") for key, _ in files}


def run_fuzz(directory: str, n: int, seed: int = 0, *, cache: bool = True) -> dict:
    """Outcome counts per entry point over ``n`` mutated files."""
    files = corpus(directory, n, seed)
    paths = _paths(directory, files)
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for path in paths.values():  # judge calls each closure at once, with this path
        counts["load_shard"][judge(lambda path=path: gs.load_shard(path), path)] += 1
        counts["inspect_shard"][judge(lambda path=path: gs.inspect_shard(path), path,
                                      infos=True)] += 1
        with gs.FileSource([path]) as src:
            counts["FileSource"][judge(lambda path=path: src.produce(path, 0).arrays, path)] += 1
    if cache:
        _fuzz_cache(directory, files, counts)
    return counts


def _fuzz_cache(directory: str, files: list, counts: dict) -> None:
    """The files as a generator's output (``cp``), and as damaged files already in the cache."""
    originals = os.path.join(directory, "originals")
    os.makedirs(originals, exist_ok=True)
    for key, original in files:
        with open(os.path.join(originals, key + ".bin"), "wb") as fp:
            fp.write(original)
    paths = _paths(directory, files)
    made = os.path.join(directory, "made")
    with gs.CommandSource([k for k, _ in files], ["cp", os.path.join(directory, "{key}.bin"),
                                                  "{path}"], cache_dir=made, retries=0) as src:
        for key, path in paths.items():
            outcome = judge(lambda key=key: src.produce(key, 0).arrays, path)
            if outcome == "typed" and os.path.exists(os.path.join(made, key + ".npy")):
                outcome = "wrong:refused file left in the cache"
            counts["CommandSource"][outcome] += 1
    cached = os.path.join(directory, "cached")
    os.makedirs(cached, exist_ok=True)
    for key, path in paths.items():
        with open(path, "rb") as src_fp, open(os.path.join(cached, key + ".npy"), "wb") as fp:
            fp.write(src_fp.read())
    with gs.CommandSource([k for k, _ in files], ["cp", os.path.join(originals, "{key}.bin"),
                                                  "{path}"], cache_dir=cached, retries=0) as src:
        for key in paths:
            outcome = judge(lambda key=key: src.produce(key, 0).arrays,
                            os.path.join(cached, key + ".npy"))
            counts["cached, then read"][outcome] += 1


def _bad(counts: dict) -> dict:
    return {where: {k: v for k, v in c.items() if k.startswith(("untyped", "wrong"))}
            for where, c in counts.items() if any(k.startswith(("untyped", "wrong")) for k in c)}


@pytest.mark.timeout(240)
def test_every_mutated_file_gives_numpys_arrays_or_a_typed_error(tmp_path):
    counts = run_fuzz(str(tmp_path), 400, seed=11)
    assert _bad(counts) == {}
    for where, outcomes in counts.items():
        assert sum(outcomes.values()) == 400, where
    for where in ("load_shard", "inspect_shard", "FileSource", "CommandSource"):
        assert counts[where]["typed"] > 250 and counts[where]["identical"] > 20, counts[where]
    # a damaged cached file is deleted and made again from the original (refused only where the
    # original itself is no shard, a 0-d array)
    assert counts["cached, then read"]["identical"] > 360, counts["cached, then read"]


def _summary(counts: dict) -> str:
    lines = []
    for where, c in counts.items():
        untyped = sum(v for k, v in c.items() if k.startswith("untyped"))
        wrong = sum(v for k, v in c.items() if k.startswith("wrong"))
        lines.append(f"{where:<20} typed {c['typed']:>5}  identical {c['identical']:>5}  "
                     f"untyped {untyped:>4}  silently wrong {wrong:>4}")
        for k, v in sorted(c.items()):
            if k.startswith(("untyped", "wrong")):
                lines.append(f"    {v:>5}  {k}")
    return "\n".join(lines)


if __name__ == "__main__":
    import tempfile
    import time

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        result = run_fuzz(tmp, n, seed=int(sys.argv[2]) if len(sys.argv) > 2 else 0)
        print(f"{n} files, {time.perf_counter() - t0:.1f} s")
        print(_summary(result))
