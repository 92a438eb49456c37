"""Validated reading and atomic writing of shard files: nothing is allocated or unpickled
before the file has been checked against its own header."""
from __future__ import annotations

import io
import os
import pickle
import struct
import zipfile

import numpy as np
import psutil
import pytest

import gluon_stream as gs
from gluon_stream import shardfile


def npy_bytes(arr) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.asarray(arr), allow_pickle=False)
    return buf.getvalue()


def header_bytes(shape, descr="<f8", version=(1, 0)) -> bytes:
    buf = io.BytesIO()
    header = {"descr": descr, "fortran_order": False, "shape": shape}
    if version == (1, 0):
        np.lib.format.write_array_header_1_0(buf, header)
    else:
        np.lib.format.write_array_header_2_0(buf, header)
    return buf.getvalue()


@pytest.fixture
def count_np_load(monkeypatch):
    """Count np.load calls (and check every one refuses pickles)."""
    calls = []
    real = np.load

    def counting_load(*args, **kw):
        assert kw.get("allow_pickle") is False
        calls.append(args)
        return real(*args, **kw)

    monkeypatch.setattr(np, "load", counting_load)
    return calls


def test_valid_npy_and_npz_round_trip(tmp_path, count_np_load):
    a = np.arange(12, dtype=np.int64).reshape(4, 3)
    b = np.linspace(0, 1, 4, dtype=np.float32)
    gs.write_shard(tmp_path / "one.npy", a)
    gs.write_shard(tmp_path / "two.npz", {"x": a, "y": b})
    (x,) = gs.load_shard(tmp_path / "one.npy")
    np.testing.assert_array_equal(x, a)
    x, y = gs.load_shard(tmp_path / "two.npz")
    np.testing.assert_array_equal(x, a)
    np.testing.assert_array_equal(y, b)
    infos = gs.inspect_shard(tmp_path / "two.npz")
    assert [(i.name, i.shape, i.dtype) for i in infos] == [("x", (4, 3), np.int64),
                                                         ("y", (4,), np.float32)]
    assert len(count_np_load) == 2
    assert sorted(os.listdir(tmp_path)) == ["one.npy", "two.npz"]  # no temp files left


def test_version_2_headers_and_zero_rows_are_fine(tmp_path):
    arr = np.zeros((0, 5), np.float32)
    path = tmp_path / "v2.npy"
    path.write_bytes(header_bytes((0, 5), "<f4", version=(2, 0)))
    assert gs.inspect_shard(path)[0].shape == (0, 5)
    assert gs.load_shard(path)[0].shape == arr.shape


def test_npy_data_that_looks_like_a_zip_trailer_is_still_npy(tmp_path):
    data = np.frombuffer(b"PK\x05\x06" + b"\x00" * 60, dtype=np.uint8).copy()
    path = tmp_path / "tricky.npy"
    path.write_bytes(npy_bytes(data))
    np.testing.assert_array_equal(gs.load_shard(path)[0], data)


@pytest.mark.parametrize("name, payload, reason", [
    ("empty", b"", r"empty file"),
    ("magic", b"hello world, not numpy", r"bad magic"),
    ("short-header", b"\x93NUMPY\x01\x00\x50", r"truncated header"),
    ("header-cut", npy_bytes(np.ones(3))[:20], r"truncated header"),
    ("data-cut", npy_bytes(np.ones((10, 3)))[:-8], r"truncated: header says \(10, 3\)"),
    ("junk", npy_bytes(np.ones(3)) + b"junk", r"size mismatch.*junk appended"),
    ("bad-header", b"\x93NUMPY\x01\x00\x10\x00{'descr': 1+}   \n", r"bad header"),
    ("version", b"\x93NUMPY\x07\x00\x10\x00" + b" " * 16, r"unsupported .npy format version 7"),
    ("negative", header_bytes((3,)).replace(b"(3,)", b"(-3,)"), r"negative dimension"),
])
def test_malformed_files_raise_corrupt_shard_naming_the_problem(tmp_path, count_np_load, name,
                                                                payload, reason):
    path = tmp_path / f"{name}.npy"
    path.write_bytes(payload)
    with pytest.raises(gs.CorruptShard, match=reason) as info:
        gs.load_shard(path)
    assert info.value.path == path and str(path) in str(info.value)
    assert "delete it" in str(info.value)
    assert count_np_load == []  # refused before numpy reads anything


@pytest.mark.parametrize("shape", [(100_000, 100_000), (2 ** 40, 2 ** 40, 2 ** 40)])
def test_a_forged_header_is_refused_before_anything_is_allocated(tmp_path, count_np_load, shape):
    path = tmp_path / "forged.npy"
    path.write_bytes(header_bytes(shape) + b"\x00" * 16)
    rss = psutil.Process().memory_info().rss
    with pytest.raises(gs.CorruptShard, match=r"truncated: header says"):
        gs.load_shard(path)
    assert count_np_load == []
    assert psutil.Process().memory_info().rss - rss < 32 << 20


def _forged_npz(path, compression):
    """An .npz whose member header and zip entry both claim 3.2 GB but which holds 16 bytes."""
    header = header_bytes((20_000, 20_000))
    claimed = len(header) + 20_000 * 20_000 * 8
    with zipfile.ZipFile(path, "w", compression=compression) as zf:
        zf.writestr("x.npy", header + b"\x00" * 16)
    data = bytearray(path.read_bytes())
    real = len(header) + 16
    for sig, offset in ((b"PK\x03\x04", 22), (b"PK\x01\x02", 24)):  # local and central entries
        at = data.index(sig)
        assert struct.unpack_from("<I", data, at + offset)[0] == real
        struct.pack_into("<I", data, at + offset, claimed)
        if compression == zipfile.ZIP_STORED:  # stored: both sizes claim the same
            struct.pack_into("<I", data, at + offset - 4, claimed)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("compression", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED])
def test_a_forged_npz_entry_is_refused_before_anything_is_allocated(tmp_path, count_np_load,
                                                                   compression):
    path = tmp_path / "forged.npz"
    _forged_npz(path, compression)
    rss = psutil.Process().memory_info().rss
    with pytest.raises(gs.CorruptShard, match=r"claims|bad .npz"):
        gs.load_shard(path)
    assert count_np_load == []
    assert psutil.Process().memory_info().rss - rss < 32 << 20


def test_compressed_npz_with_a_high_but_honest_ratio_loads(tmp_path):
    arrays = {"zeros": np.zeros((2000, 100)), "ids": np.arange(2000)}
    np.savez_compressed(tmp_path / "z.npz", **arrays)
    zeros, ids = gs.load_shard(tmp_path / "z.npz")
    np.testing.assert_array_equal(zeros, arrays["zeros"])
    np.testing.assert_array_equal(ids, arrays["ids"])


def test_a_header_length_field_beyond_reason_is_refused(tmp_path):
    path = tmp_path / "long.npy"
    path.write_bytes(b"\x93NUMPY\x02\x00" + struct.pack("<I", 2 ** 31) + b" " * 64)
    with pytest.raises(gs.CorruptShard, match=r"header claims 2147483648 bytes"):
        gs.inspect_shard(path)


class Marker:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_pickles_are_unsafe_and_never_run(tmp_path, count_np_load):
    marker = tmp_path / "marker"
    path = tmp_path / "evil.npy"
    path.write_bytes(pickle.dumps(Marker(str(marker)), protocol=2))
    with pytest.raises(gs.UnsafeShard, match=r"is a pickle"):
        gs.load_shard(path)
    assert not marker.exists() and count_np_load == []


def test_object_arrays_are_unsafe_in_npy_and_npz(tmp_path, count_np_load):
    marker = tmp_path / "marker"
    obj = np.array([Marker(str(marker)), 1], dtype=object)
    np.save(tmp_path / "obj.npy", obj, allow_pickle=True)
    np.savez(tmp_path / "obj.npz", ok=np.ones(2), bad=obj)
    for name in ("obj.npy", "obj.npz"):
        with pytest.raises(gs.UnsafeShard, match=r"holds Python objects"):
            gs.load_shard(tmp_path / name)
    assert not marker.exists() and count_np_load == []


def test_npz_members_are_checked_like_npy_files(tmp_path):
    path = tmp_path / "mixed.npz"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("x.npy", npy_bytes(np.ones(3)))
        zf.writestr("notes.txt", b"hello")
    with pytest.raises(gs.CorruptShard, match=r"'notes.txt' is not a .npy array"):
        gs.load_shard(path)
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("x.npy", npy_bytes(np.ones(3)) + b"junk")
    with pytest.raises(gs.CorruptShard, match=r"junk appended"):
        gs.load_shard(path)
    good = npy_bytes(np.ones(3))
    path.write_bytes(b"PK\x03\x04" + good)
    with pytest.raises(gs.CorruptShard, match=r"bad .npz archive"):
        gs.load_shard(path)
    with zipfile.ZipFile(path, "w"):
        pass
    with pytest.raises(gs.CorruptShard, match=r"empty .npz"):
        gs.load_shard(path)


def test_a_missing_file_is_reported(tmp_path):
    with pytest.raises(gs.CorruptShard, match=r"does not exist"):
        gs.load_shard(tmp_path / "nope.npy")


def test_write_shard_is_atomic_and_cleans_up_when_interrupted(tmp_path, monkeypatch):
    path = tmp_path / "s.npy"
    gs.write_shard(path, np.ones(5))

    def interrupted(fp, array, **kw):
        fp.write(b"\x93NUMPY partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(np.lib.format, "write_array", interrupted)
    with pytest.raises(KeyboardInterrupt):
        gs.write_shard(path, np.zeros(5))
    assert os.listdir(tmp_path) == ["s.npy"]  # the old shard intact, no temp file
    np.testing.assert_array_equal(gs.load_shard(path)[0], np.ones(5))


def test_normalize_arrays_refuses_what_cannot_be_batched():
    with pytest.raises(gs.UnsafeShard, match=r"Python objects"):
        shardfile.normalize_arrays(np.array([{}, 1], dtype=object), what="shard 1")
    with pytest.raises(ValueError, match=r"first \(sample\) dimension"):
        shardfile.normalize_arrays((np.ones(3), np.ones(4)), what="shard 1")
    with pytest.raises(ValueError, match=r"scalar"):
        shardfile.normalize_arrays(np.float32(1), what="shard 1")
    with pytest.raises(ValueError, match=r"no arrays"):
        shardfile.normalize_arrays((), what="shard 1")
