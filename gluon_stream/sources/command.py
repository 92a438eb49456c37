"""CommandSource: each shard is written by an external program, run per key."""
from __future__ import annotations

import errno
import logging
import os
import re
import stat
from typing import Any, Mapping, Sequence

from .._cache import SUFFIXES
from .._cache.recipe import recipe_digest
from .._utils import validate as _validate
from .._utils.files import discard_path, is_disk_full
from .._utils.retry import RetryPolicy
from ..errors import CommandNotFound, CorruptShard, ShardError, ShardTimeout, UnsafeShard
from ..shardfile import inspect_shard
from ._process import ProgramRunner
from .base import CachingSource, Keys, validate_key

__all__ = ["CommandSource"]

logger = logging.getLogger(__name__)

_TOKEN = re.compile(r"\{(?:key|path|epoch)\}")
_CANNOT_START = (errno.ENOENT, errno.EACCES, errno.ENOEXEC, errno.ENOTDIR, errno.ELOOP)


class CommandSource(CachingSource):
    """Generate each shard by running an external program.

    Args:
        keys: Shard keys (sequence, iterator, or ``keys(epoch)``).
        command: Argument vector; ``{key}``, ``{path}`` and ``{epoch}`` are replaced per shard.
            The program must write the shard to ``{path}`` (a temporary file in ``cache_dir``
            that is renamed into place only once complete and valid). Never run through a shell.
        cache_dir: Directory of finished shards; keys already there are not regenerated.
            With ``{epoch}`` in the command, shards are cached per (key, epoch).
        timeout: Seconds one run may take before its whole process group is killed.
        retries: Extra attempts after a failed run, with exponential backoff.
        backoff: Seconds before the first retry (doubling each time).
        suffix: ``.npy`` or ``.npz``: what the program writes.
        env: Environment for the program (default: inherited).
        lock_timeout: Seconds to wait for another process generating the same key.
        mmap: Memory-map loaded ``.npy`` files.
        cache_limit: Keep at most this many shards (an int) or bytes (``'20GB'``) in the cache,
            evicting the least recently used.
        version: Any text that names what the program makes; change it when the program
            changes but its command line does not (a rebuilt binary, new input data).
        on_change: A cached shard made by another command template, ``env`` or ``version``
            (recorded on the file) is ``'regenerate'``d with a WARNING naming the change
            (default), or ``'raise'`` refuses it with ``StaleShard``. The program only sees
            ``str(key)``, so keys ``1`` and ``'1'`` make the same shard; a key list holding
            both is refused.

    Example:
        >>> src = CommandSource(["2024-01-01"], ["./gen", "--date", "{key}", "--out", "{path}"],
        ...                     cache_dir="shards")  # doctest: +SKIP
    """

    def __init__(self, keys: Keys, command: Sequence[str], *, cache_dir: str | os.PathLike,
                 timeout: float | None = 600.0, retries: int = 2, backoff: float = 0.5,
                 suffix: str = ".npy", env: Mapping[str, str] | None = None,
                 lock_timeout: float = 3600.0, mmap: bool = False,
                 cache_limit: int | str | None = None, version: str | None = None,
                 on_change: str = "regenerate") -> None:
        if isinstance(command, (str, bytes)) or not command:
            raise TypeError("command must be a non-empty list of arguments (argv), e.g. "
                            "['./gen', '--date', '{key}', '--out', '{path}']; it never runs in a "
                            "shell")
        if not any("{path}" in str(arg) for arg in command):
            raise ValueError("command must contain '{path}': the program writes the shard there")
        retries = _validate.integer("retries", retries, minimum=0)
        timeout = _validate.seconds("timeout", timeout, allow_none=True)
        _validate.choice("suffix", suffix, SUFFIXES)
        if cache_dir is None:
            raise ValueError("CommandSource needs a cache_dir: the program writes files there")
        super().__init__(keys, cache_dir, lock_timeout, mmap, cache_limit, on_change)
        self.command = [str(arg) for arg in command]
        self.timeout = timeout
        self.retry = RetryPolicy(retries, _validate.seconds("backoff", backoff, positive=False))
        self.suffix = suffix
        self.env = env
        self.version = None if version is None else str(version)
        self._runner = ProgramRunner()

    @property
    def retries(self) -> int:
        return self.retry.retries

    @property
    def generates_apart(self) -> bool:
        """With a ``cache_dir``, the program writes a shard there; this process holds none of
        it until it is loaded."""
        return self.cached

    @property
    def per_epoch(self) -> bool:
        """True when the command uses ``{epoch}``: shards are made and cached per epoch."""
        return any("{epoch}" in arg for arg in self.command)

    def shard_name(self, key: Any, epoch: int) -> str:
        name = validate_key(key)
        return f"{name}@e{epoch}" if self.per_epoch else name

    def recipe(self, key: Any, epoch: int) -> dict:
        """The command template and fixed arguments, a digest of ``env``, and ``version``."""
        env = None if self.env is None else recipe_digest(sorted(self.env.items()))
        return {"source": "CommandSource", "command": self.command, "env": env,
                "version": self.version}

    def argv_for(self, key: Any, epoch: int, path: str) -> list[str]:
        """The argument vector for one run (tokens replaced literally, no other formatting)."""
        values = {"{key}": validate_key(key), "{path}": path, "{epoch}": str(epoch)}
        # one pass, so a token inside a substituted value (a cache_dir named '{epoch}') stays
        return [_TOKEN.sub(lambda m: values[m.group(0)], arg) for arg in self.command]

    def _create(self, key: Any, epoch: int) -> str:
        name = self.shard_name(key, epoch)
        attempt = -1
        while True:  # the last attempt raises (should_retry: no)
            attempt += 1
            tmp = self._require_cache().temp_path(name, self.suffix)
            try:
                self._run_once(key, epoch, tmp)
                if not os.path.islink(tmp):
                    inspect_shard(tmp)
                return tmp
            except (ShardError, CorruptShard, UnsafeShard) as exc:
                discard_path(tmp)
                self._check_open()
                if not self.retry.should_retry(exc, attempt):
                    # read by the failure record; not a declared attribute of these error types
                    setattr(exc, "attempts", attempt + 1)  # noqa: B010
                    if attempt and isinstance(exc, ShardError) and exc.args:
                        exc.args = (f"{exc.args[0]}\n(gave up after {attempt + 1} attempts; "
                                    "retries= sets how many)",)
                    raise
                delay = self.retry.delay(attempt)
                logger.warning("shard %r: attempt %d/%d failed (%s); retrying in %.1f s",
                               key, attempt + 1, self.retry.attempts, exc, delay)
                if self._closed.wait(delay):
                    self._check_open()
            except BaseException:
                discard_path(tmp)
                raise

    def _run_once(self, key: Any, epoch: int, tmp: str) -> None:
        """Run the generator once and turn how it ended into a ShardError, or return."""
        argv = self.argv_for(key, epoch, tmp)
        try:
            result = self._runner.run(argv, timeout=self.timeout, env=self.env,
                                      closed=self._closed)
        except OSError as exc:
            cls = CommandNotFound if exc.errno in _CANNOT_START else ShardError
            raise cls(f"shard {key!r}: cannot start {argv[0]!r}: {exc}; check the first "
                      "element of command (an executable path)"
                      + (" (not retried)" if cls is CommandNotFound else ""), key=key,
                      argv=argv) from exc
        self._check_open()
        text, code = result.stderr_tail, result.returncode
        if result.timed_out:
            raise ShardTimeout(
                f"shard {key!r}: generator ran longer than timeout={self.timeout} s and was killed "
                f"with its process group; raise timeout= or make the program faster; command: "
                f"{argv}; stderr tail:\n{text}",
                key=key, argv=argv, returncode=code, stderr_tail=text)
        if code != 0:
            if is_disk_full(text):
                raise ShardError(
                    f"shard {key!r}: disk full: the generator's stderr reports a full disk or "
                    f"quota writing {tmp!r}; free space in {self._require_cache().root!r} or point "
                    f"cache_dir elsewhere (not retried); command: {argv}; stderr tail:\n{text}",
                    key=key, argv=argv, returncode=code, stderr_tail=text, disk_full=True)
            how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
            raise ShardError(f"shard {key!r}: generator failed ({how}); command: {argv}; "
                             f"stderr tail:\n{text}", key=key, argv=argv, returncode=code,
                             stderr_tail=text)
        problem = self._output_problem(tmp)
        if problem:
            raise ShardError(f"shard {key!r}: generator exited 0 but {problem}; command: {argv}; "
                             f"stderr tail:\n{text}", key=key, argv=argv, returncode=0,
                             stderr_tail=text)

    def _output_problem(self, tmp: str) -> str | None:
        """What is wrong with what the generator left at ``tmp`` (None: a file or a symlink,
        judged later); anything wrong there is removed. Nothing is opened here."""
        try:
            mode = os.lstat(tmp).st_mode
        except FileNotFoundError:
            return self._missing_output(tmp)
        if stat.S_ISREG(mode) or stat.S_ISLNK(mode):
            return None
        discard_path(tmp)
        kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO, socket or device"
        return (f"made {kind} at {tmp!r} (removed); it must write a regular file to the "
                "'{path}' argument")

    def _missing_output(self, tmp: str) -> str:
        misnamed = [tmp + ext for ext in SUFFIXES if os.path.lexists(tmp + ext)]
        for path in misnamed:
            discard_path(path)
        if misnamed:
            ext = os.path.splitext(misnamed[0])[1]
            hint = (" (for .npz output also pass suffix='.npz')"
                    if ext == ".npz" and self.suffix != ".npz" else "")
            return (f"wrote {misnamed[0]!r} (removed) instead of {tmp!r}: np.save/np.savez add "
                    f"'{ext}' to a name that does not end in it. Write exactly the '{{path}}' "
                    "argument by passing an open file: with open(path, 'wb') as f: "
                    f"np.save(f, ...) or np.savez(f, ...){hint}")
        if not os.path.isdir(self._require_cache().root):
            return (f"cache_dir {self._require_cache().root!r} was deleted while it ran, with the "
                    "file it wrote")
        return f"wrote no file at {tmp!r} (it must write to the '{{path}}' argument)"

    def close(self) -> None:
        """Kill every running generator (whole process groups); idempotent."""
        super().close()
        self._runner.kill_all()
