"""``gluon-stream inspect`` applies the loader's rules: a file the loader would refuse is flagged
with the same reason, damaged headers are one line each (never a traceback), nothing blocks."""
from __future__ import annotations

import io
import os

import numpy as np
import pytest

import gluon_stream as gs
from gluon_stream._utils import columns as _batchable
from gluon_stream.cli import main


def test_one_file_is_one_file(tmp_path, capsys):
    np.save(tmp_path / "a.npy", np.zeros((3, 2), np.float32))
    assert main(["inspect", str(tmp_path / "a.npy")]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "1 file, 1 readable, 0 unreadable"


def test_arrays_mxnet_cannot_batch_are_flagged_with_the_loaders_reason(tmp_path, capsys):
    dates = np.array(["2024-01-01", "2024-01-02"], dtype="datetime64[D]")
    np.savez(tmp_path / "dated.npz", x=np.zeros((2, 3), np.float32), label=dates)
    np.save(tmp_path / "ok.npy", np.zeros((2, 3), np.float32))
    assert main(["inspect", str(tmp_path)]) == 1
    out = capsys.readouterr().out.splitlines()
    flagged = [line for line in out if "NOT BATCHABLE" in line]
    assert len(flagged) == 1 and flagged[0].startswith("dated")
    with pytest.raises(gs.UnbatchableShard) as info:  # the rule the loader applies
        _batchable.check_batchable(gs.inspect_shard(tmp_path / "dated.npz"),
                                  what=f"shard file {str(tmp_path / 'dated.npz')!r}")
    assert flagged[0].endswith(str(info.value))
    assert "array 'label' has dtype datetime64[D]" in flagged[0] and "astype('int64')" in flagged[0]
    assert out[-1] == "2 files, 1 readable, 0 unreadable, 1 not batchable as stored"


@pytest.mark.timeout(60)
def test_damaged_headers_and_fifos_are_one_line_each(tmp_path, capsys):
    (tmp_path / "flipped.npy").write_bytes(  # '}' flipped: numpy's tokenizer raised TokenError
        npy_bytes(np.ones(3)).replace(b"}", b" ", 1))
    os.mkfifo(tmp_path / "pipe.npy")
    assert main(["inspect", str(tmp_path / "flipped.npy"), str(tmp_path / "pipe.npy")]) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    lines = captured.out.splitlines()
    assert any(line.startswith("flipped") and "UNREADABLE" in line and "bad header" in line
               for line in lines)
    assert any(line.startswith("pipe") and "UNREADABLE" in line and "FIFO" in line
               for line in lines)
    assert lines[-1] == "2 files, 0 readable, 2 unreadable"


def npy_bytes(arr) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, arr, allow_pickle=False)
    return buf.getvalue()
