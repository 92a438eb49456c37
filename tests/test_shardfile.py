"""Validated reading and atomic writing of shard files: nothing is allocated or unpickled
before the file has been checked against its own header."""
from __future__ import annotations

import io
import os
import pickle
import struct
import warnings
import zipfile

import numpy as np
import psutil
import pytest

import gluon_stream as gs
from gluon_stream._utils import columns as _batchable
from gluon_stream._utils import columns as _columns
from gluon_stream._utils import files as _files


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
        _columns.normalize_arrays(np.array([{}, 1], dtype=object), what="shard 1")
    with pytest.raises(ValueError, match=r"first \(sample\) dimension"):
        _columns.normalize_arrays((np.ones(3), np.ones(4)), what="shard 1")
    with pytest.raises(ValueError, match=r"scalar"):
        _columns.normalize_arrays(np.float32(1), what="shard 1")
    with pytest.raises(ValueError, match=r"no arrays"):
        _columns.normalize_arrays((), what="shard 1")


# -- a shard's arrays share one sample axis -------------------------------------------------

def test_npz_arrays_of_different_lengths_are_refused_from_their_headers(tmp_path, count_np_load):
    for x, y in ((10, 7), (7, 10)):
        path = tmp_path / f"xy{x}-{y}.npz"
        np.savez(path, x=np.zeros((x, 3)), y=np.arange(y))
        for read in (gs.inspect_shard, gs.load_shard):
            with pytest.raises(gs.CorruptShard, match=rf"first \(sample\) dimension \('x': {x}, "
                                                      rf"'y': {y}") as info:
                read(path)
            assert info.value.path == path
    assert count_np_load == []  # refused before numpy reads any data


def test_0d_arrays_have_no_sample_axis(tmp_path, count_np_load):
    np.save(tmp_path / "scalar.npy", np.float32(3))
    np.savez(tmp_path / "scalar.npz", x=np.zeros(3), y=np.float32(3))
    with pytest.raises(gs.CorruptShard, match=r"array 'arr_0' is 0-d .*no sample axis"):
        gs.load_shard(tmp_path / "scalar.npy")
    with pytest.raises(gs.CorruptShard, match=r"array 'y' is 0-d"):
        gs.inspect_shard(tmp_path / "scalar.npz")
    assert count_np_load == []


# -- bad files the fuzz found: typed errors, never raw ones ----------------------------------

def raw_header(text: str) -> bytes:
    raw = text.encode("latin1")
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(raw)) + raw


def npz_with(members, method=zipfile.ZIP_STORED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # duplicate names are one of the cases
        for name, payload in members:
            zf.writestr(zipfile.ZipInfo(name), payload, compress_type=method)
    return buf.getvalue()


def set_zip_field(data: bytes, local: int, central: int, value: int) -> bytes:
    buf = bytearray(data)
    for sig, offset in ((b"PK\x03\x04", local), (b"PK\x01\x02", central)):
        start = 0
        while (at := buf.find(sig, start)) >= 0:
            struct.pack_into("<H", buf, at + offset, value)
            start = at + 4
    return bytes(buf)


def damaged_bz2() -> bytes:
    data = bytearray(npz_with([("x.npy", npy_bytes(np.arange(50.0)))], zipfile.ZIP_BZIP2))
    start = data.index(b"BZh")
    for i in range(8, 40):
        data[start + i] ^= 0x55
    return bytes(data)


@pytest.mark.parametrize("name, payload, reason", [
    ("unclosed-bracket",  # one flipped byte: '}' -> ' '; numpy's tokenizer raised TokenError
     npy_bytes(np.ones(3)).replace(b"}", b" ", 1), r"bad header \(TokenError"),
    ("zero-itemsize", raw_header("{'descr': '|V0', 'fortran_order': False, "
                                 "'shape': (1099511627776,), }\n"), r"0-byte items"),
    ("unaddressable", raw_header("{'descr': '<f4', 'fortran_order': False, "
                                 "'shape': (0, 18446744073709551616), }\n"),
     r"larger than numpy can address"),
    ("bool-shape", raw_header("{'descr': '<f8', 'fortran_order': False, 'shape': (True,), }\n")
     + b"\x00" * 8, r"holds a bool"),
    ("subarray", raw_header("{'descr': ('<i4', (2,)), 'fortran_order': False, "
                            "'shape': (3,), }\n") + b"\x00" * 24, r"subarray dtype"),
    ("version-1.1", npy_bytes(np.ones(3)).replace(b"NUMPY\x01\x00", b"NUMPY\x01\x01"),
     r"version 1.1"),
    ("encrypted", set_zip_field(npz_with([("x.npy", npy_bytes(np.ones(3)))]), 6, 8, 1),
     r"'x.npy' is encrypted"),
    ("method-99", set_zip_field(npz_with([("x.npy", npy_bytes(np.ones(3)))]), 8, 10, 99),
     r"compression method 99"),
    ("bad-bz2", damaged_bz2(), r"bad .npz archive|unreadable"),
    ("duplicate", npz_with([("x.npy", npy_bytes(np.ones(3))), ("x.npy", npy_bytes(np.ones(3)))]),
     r"'x.npy' is ambiguous"),
    ("shadowed", npz_with([("x.npy", npy_bytes(np.ones(3))),
                           ("x.npy.npy", npy_bytes(np.zeros(3)))]), r"ambiguous"),
])
def test_damaged_files_raise_corrupt_shard_not_raw_errors(tmp_path, name, payload, reason):
    path = tmp_path / f"{name}.bin"
    path.write_bytes(payload)
    for read in (gs.inspect_shard, gs.load_shard):
        with pytest.raises(gs.CorruptShard, match=reason) as info:
            read(path)
        assert info.value.path == path and str(path) in str(info.value)


@pytest.mark.timeout(20)
def test_only_regular_files_are_opened(tmp_path):
    fifo = tmp_path / "pipe.npy"
    os.mkfifo(fifo)
    for read in (gs.inspect_shard, gs.load_shard):  # a FIFO would block open() forever
        with pytest.raises(gs.CorruptShard, match=r"is a FIFO \(named pipe\), not a shard file"):
            read(fifo)
    (tmp_path / "dir.npy").mkdir()
    with pytest.raises(gs.CorruptShard, match=r"is a directory.*FileSource\('dir'\)"):
        gs.load_shard(tmp_path / "dir.npy")


def test_memory_mapped_loads_match_np_load(tmp_path):
    for name, arr in (("c", np.arange(12.0).reshape(4, 3)),
                      ("f", np.asfortranarray(np.arange(12, dtype=">i4").reshape(4, 3))),
                      ("empty", np.zeros((0, 5), np.float32))):
        np.save(tmp_path / f"{name}.npy", arr)
        (got,) = gs.load_shard(tmp_path / f"{name}.npy", mmap=True)
        want = np.load(tmp_path / f"{name}.npy", mmap_mode="r")
        assert isinstance(got, np.memmap) and got.dtype == want.dtype
        assert got.flags.f_contiguous == want.flags.f_contiguous
        np.testing.assert_array_equal(got, want)
        del got, want


# -- what MXNet can batch ----------------------------------------------------------------------

@pytest.mark.parametrize("arr, fix", [
    (np.array(["2024-01-01", "2024-01-02"], dtype="datetime64[D]"), r"astype\('int64'\)"),
    (np.array([1, 2], dtype="timedelta64[s]"), r"np.timedelta64\(1, 's'\)"),
    (np.arange(2, dtype=np.uint16), r"astype\('int32'\)"),
    (np.arange(2, dtype=np.int16), r"astype\('int32'\)"),
    (np.arange(2, dtype=np.uint32), r"astype\('int64'\)"),
    (np.arange(2) * 1j, r"split real and imaginary parts"),
    (np.array(["ab", "c"]), r"integer ids"),
    (np.array([b"ab", b"c"]), r"integer ids"),
    (np.zeros(2, dtype=[("a", "<i4"), ("b", "<f8")]), r"each field as its own array"),
    (np.zeros(2, dtype="V4"), r"view the bytes as uint8"),
    (np.zeros(2, dtype=np.longdouble), r"astype\('float64'\)"),
])
def test_dtypes_mxnet_cannot_batch_are_named_with_a_fix(tmp_path, arr, fix):
    labels = np.zeros(len(arr), np.float32)
    with pytest.raises(gs.UnbatchableShard, match=rf"shard '2024-01-01': array 1 has dtype "
                                                  rf".*MXNet cannot batch.*{fix}") as info:
        _batchable.check_batchable((labels, arr), what="shard '2024-01-01'")
    assert info.value.array == 1 and info.value.dtype == arr.dtype and info.value.fix
    assert isinstance(info.value, gs.SchemaMismatch)
    np.savez(tmp_path / "s.npz", x=labels, label=arr)  # the same rule on a file's headers
    with pytest.raises(gs.UnbatchableShard, match=r"file 's.npz': array 'label' has dtype"):
        _batchable.check_batchable(gs.inspect_shard(tmp_path / "s.npz"), what="file 's.npz'")
    with pytest.raises(gs.UnbatchableShard, match=r"array 'label'"):
        _batchable.check_batchable({"x": labels, "label": arr}, what="shard 1")


def test_batchable_arrays_pass_and_empty_sample_axes_do_not():
    ok = [np.zeros((4, 3), np.dtype(d).newbyteorder(order)) for d in _batchable.MXNET_DTYPES
          for order in "<>"]
    _batchable.check_batchable(ok, what="shard 1")
    _batchable.check_batchable(np.zeros((0, 3)), what="shard 1")  # an empty shard is fine
    with pytest.raises(gs.UnbatchableShard, match=r"array 0 has shape \(4, 0\): MXNet 1.9 reads "
                                                  r"a 0 in a shape as unknown"):
        _batchable.check_batchable(np.zeros((4, 0), np.float32), what="shard 1")
    with pytest.raises(gs.UnbatchableShard, match=r"is 0-d"):
        _batchable.check_batchable([np.float32(1)], what="shard 1")


@pytest.mark.mxnet
def test_mxnet_dtypes_is_the_installed_mxnets_table():
    import mxnet as mx

    table = mx.ndarray.ndarray._DTYPE_NP_TO_MX  # read here only to keep MXNET_DTYPES honest
    holds = {np.dtype(t) for t in table if t is not None and np.dtype(t).names is None}
    assert holds == set(_batchable.MXNET_DTYPES)
    for dtype in ("datetime64[D]", "uint16", "complex64", "U3", "int16"):
        with pytest.raises(KeyError):  # what users saw, naming no shard
            mx.nd.empty((2,), dtype=dtype)


# -- what a function returns ---------------------------------------------------------------------

class FakeNDArray:
    """Stands in for mx.nd.NDArray: no __array__, numpy would see a sequence of objects."""

    def __init__(self, arr):
        self._arr = arr

    def asnumpy(self):
        return self._arr.copy()

    def __len__(self):
        return len(self._arr)

    def __getitem__(self, i):
        return FakeNDArray(self._arr[i])


def test_ndarray_like_values_are_accepted_without_warnings(recwarn):
    x, y = np.arange(6.0).reshape(3, 2), np.arange(3)
    out = _columns.normalize_arrays((FakeNDArray(x), FakeNDArray(y)), what="shard 1")
    np.testing.assert_array_equal(out[0], x)
    np.testing.assert_array_equal(out[1], y)
    (single,) = _columns.normalize_arrays(FakeNDArray(x), what="shard 1")
    np.testing.assert_array_equal(single, x)
    label, data = _columns.normalize_arrays({"softmax_label": FakeNDArray(y),
                                              "data": FakeNDArray(x)}, what="shard 1")
    assert (label.shape, data.shape) == ((3,), (3, 2))  # a dict keeps its key order
    assert [str(w.message) for w in recwarn] == []


@pytest.mark.mxnet
def test_real_ndarrays_are_accepted(recwarn):
    import mxnet as mx

    data, label = _columns.normalize_arrays({"data": mx.nd.ones((4, 2)), "label": mx.nd.zeros(4)},
                                             what="shard 1")
    assert data.shape == (4, 2) and label.shape == (4,) and isinstance(data, np.ndarray)
    assert [str(w.message) for w in recwarn] == []


def test_a_list_of_same_shaped_rows_is_ambiguous():
    rows = [np.arange(4.0) + i for i in range(10)]
    with pytest.raises(gs.SchemaMismatch, match=r"a list of 10 arrays of one shape \(4,\) .* "
                                                r"ambiguous .*tuple of columns.*np.stack\(rows\)"):
        _columns.normalize_arrays(rows, what="shard 1")
    with pytest.raises(gs.SchemaMismatch, match=r"ambiguous"):
        _columns.normalize_arrays([[1.0, 2.0], [3.0, 4.0]], what="shard 1")
    columns = _columns.normalize_arrays([np.zeros((10, 4)), np.arange(10)], what="shard 1")
    assert [c.shape for c in columns] == [(10, 4), (10,)]  # unambiguous: columns
    same = _columns.normalize_arrays(tuple(rows[:2]), what="shard 1")
    assert len(same) == 2  # a tuple is always columns


# -- disk full -----------------------------------------------------------------------------------

def test_a_short_write_without_errno_is_disk_full(tmp_path, monkeypatch):
    def short_write(fp, array, **kw):
        fp.write(b"\x93NUMPY")
        raise OSError("800 requested and 0 written")  # what numpy's tofile raises

    monkeypatch.setattr(np.lib.format, "write_array", short_write)
    with pytest.raises(gs.ShardError, match=r"disk full .*800 requested and 0 written") as info:
        gs.write_shard(tmp_path / "s.npy", np.ones(100))
    assert info.value.disk_full
    assert os.listdir(tmp_path) == []
    assert _files.is_disk_full("OSError: 8192 requested and 4096 written")
    assert not _files.is_disk_full(OSError("transient"))


# -- samples as Gluon's list datasets hold them ----------------------------------------------------

def test_a_list_of_samples_becomes_columns(recwarn):
    data, label = _columns.normalize_arrays([([1, 2], 0), ([3, 4], 1)], what="shard 1")
    assert data.tolist() == [[1, 2], [3, 4]] and label.tolist() == [0, 1]
    x, y = _columns.normalize_arrays(((np.ones(3), 0.5), (np.zeros(3), 1.5)), what="shard 1")
    assert x.shape == (2, 3) and y.tolist() == [0.5, 1.5]
    x, y = _columns.normalize_arrays([(FakeNDArray(np.ones(2)), 0)] * 3, what="shard 1")
    assert x.shape == (3, 2) and y.tolist() == [0, 0, 0]
    pairs = _columns.normalize_arrays([(1, 0), (2, 1), (3, 0)], what="shard 1")
    assert [c.tolist() for c in pairs] == [[1, 2, 3], [0, 1, 0]]  # as rows, they were refused
    columns = _columns.normalize_arrays(((1, 2), (3, 4)), what="shard 1")
    assert [c.tolist() for c in columns] == [[1, 2], [3, 4]]  # a tuple is columns, as before
    assert [str(w.message) for w in recwarn] == []  # no ragged-array warning from numpy


def test_samples_that_also_read_as_columns_or_differ_in_shape_are_refused():
    with pytest.raises(gs.SchemaMismatch, match=r"shard 1: a list of 2 tuples of 3 values is "
                                                r"ambiguous: 2 samples of 3 fields, or 2 columns "
                                                r"of 3 samples\? Return columns: a tuple"):
        _columns.normalize_arrays([(1.0, 2.0, 3.0), (0, 1, 0)], what="shard 1")
    with pytest.raises(gs.SchemaMismatch, match=r"field 0 of the 2 samples differs in shape "
                                                r"\(\[\(1,\), \(2,\)\]\).*Return columns"):
        _columns.normalize_arrays([([1], 0), ([2, 3], 1)], what="shard 1")
    with pytest.raises(gs.UnsafeShard, match=r"field 1 of the samples has dtype object"):
        _columns.normalize_arrays([([1], {}), ([2], {})], what="shard 1")


@pytest.mark.mxnet
def test_gluons_list_dataset_as_a_function_source():
    """MXNet's test_list_dataset, ported: fn returns the list of samples a DataLoader takes."""
    import mxnet as mx

    samples = [([1, 2], 0), ([3, 4], 1)]
    gluon = [[a.asnumpy().tolist() for a in batch]
             for batch in mx.gluon.data.DataLoader(samples, batch_size=1)]
    with gs.StreamLoader(gs.FunctionSource([0], lambda key: samples), batch_size=1) as loader:
        ours = [[a.asnumpy().tolist() for a in batch] for batch in loader]
    assert ours == gluon == [[[[1, 2]], [0]], [[[3, 4]], [1]]]
