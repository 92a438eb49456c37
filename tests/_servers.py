"""Real engines for the tests, each started by the test that uses it and stopped after it.

* :func:`s3`: a moto S3 server on 127.0.0.1 (a child process; its port is the one it bound),
  reached through s3fs with fake credentials. Nothing leaves the loopback interface. The server
  (:func:`moto_server`) is started once per test module and emptied after each test.
* :func:`dead_s3`: the same settings pointing at a port where nothing listens.
* :func:`dask_cluster`: a process-based ``dask.distributed.LocalCluster`` and its client.

Import the fixtures into a test module (``from _servers import s3``) to use them.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import urllib.request
from dataclasses import dataclass
from typing import Any, Iterator

import psutil
import pytest

from _helpers import JOIN_S

_MOTO = r"""
import sys
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
sys.stdin.read()  # serve until the test closes our stdin
server.stop()
"""


@dataclass(frozen=True)
class S3:
    """An S3 endpoint and the environment that reaches it (already set in this process)."""

    endpoint: str
    env: dict


def s3_env(endpoint: str, tmp_path: Any) -> dict:
    """Fake credentials for ``endpoint``; no profile or config file of the machine is read."""
    return {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint, "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials")}


def _fresh_s3fs() -> None:
    """Forget s3fs instances (each is bound to the endpoint it was made for) and let their
    sessions close."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture(scope="session")
def warm_fsspec() -> None:
    """fsspec runs its async backends on one thread per process, started on first use and kept:
    start it before the leak check looks, as conftest warms MXNet."""
    pytest.importorskip("fsspec")
    from fsspec.asyn import get_loop

    get_loop()


def _use_env(monkeypatch: pytest.MonkeyPatch, env: dict) -> None:
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


@pytest.fixture(scope="module")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A moto S3 server for the tests of one module (its start, a second or two, is paid once):
    its endpoint. :func:`s3` empties it after each test; it stops after the module's last."""
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    log_path = tmp_path_factory.mktemp("moto") / "moto.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-c", _MOTO], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=log)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        line = proc.stdout.readline()
        if not line.strip().isdigit():
            raise RuntimeError(f"moto server did not start: {log_path.read_text()[-2000:]}")
        yield f"http://127.0.0.1:{int(line)}"
    finally:
        _stop(proc)


def _reset(endpoint: str) -> None:
    """Delete every bucket and object the test made (moto's own reset endpoint)."""
    request = urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST")
    with urllib.request.urlopen(request, timeout=JOIN_S) as response:
        assert response.status == 200, response.status


@pytest.fixture
def s3(moto_server: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
       warm_fsspec: None) -> Iterator[S3]:
    """The module's moto S3 server, empty, for this test; AWS_* set here (children inherit
    them)."""
    env = s3_env(moto_server, tmp_path)
    _use_env(monkeypatch, env)
    _fresh_s3fs()
    try:
        yield S3(moto_server, env)
    finally:
        _fresh_s3fs()
        _reset(moto_server)


def _stop(proc: subprocess.Popen) -> None:
    """End the server: close its stdin (it stops by itself), kill it if it does not."""
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            stream.close()
    try:
        proc.wait(timeout=JOIN_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=JOIN_S)


@pytest.fixture
def dead_s3(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, warm_fsspec: None) -> Iterator[S3]:
    """S3 settings for a port on 127.0.0.1 that is bound but never listens: every connection is
    refused at once. botocore retries once (AWS_MAX_ATTEMPTS=1) so the test takes no time."""
    pytest.importorskip("s3fs")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        env = s3_env(f"http://127.0.0.1:{sock.getsockname()[1]}", tmp_path)
        env["AWS_MAX_ATTEMPTS"] = "1"
        _use_env(monkeypatch, env)
        _fresh_s3fs()
        try:
            yield S3(env["AWS_ENDPOINT_URL"], env)
        finally:
            _fresh_s3fs()


def ends_with_the_process(child: psutil.Process) -> bool:
    """Gone already, or multiprocessing's resource tracker (one per process, kept by design)."""
    try:
        return child.status() == psutil.STATUS_ZOMBIE or \
            any("resource_tracker" in part for part in child.cmdline())
    except psutil.NoSuchProcess:
        return True


@dataclass
class DaskCluster:
    """A running process-based cluster: ``client``, and its workers' pids."""

    client: Any
    worker_pids: set


@pytest.fixture
def dask_cluster() -> Iterator[DaskCluster]:
    """``LocalCluster(processes=True, n_workers=2, threads_per_worker=1)`` and a client, both
    closed after the test; the test fails if a worker process outlives them."""
    distributed = pytest.importorskip("distributed")
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=None) as cluster, \
            distributed.Client(cluster) as client:
        yield DaskCluster(client, set(client.run(os.getpid).values()))
    left = [c.pid for c in psutil.Process().children(recursive=True)
            if c.pid not in before and not ends_with_the_process(c)]
    assert not left, f"dask processes outlived their cluster: {left}"
    assert not [t.name for t in threading.enumerate() if t.name.startswith("gluon_stream")]
