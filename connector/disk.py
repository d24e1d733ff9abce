"""The disk tier: chunk bytes in files of one directory, ``remote_url`` ``file:///path/to/dir``.

A ``connector.tiers.Tier``: engines on one machine (or on machines sharing a filesystem whose
``stat`` is fast) that name the same directory share their chunks, as they would through a
Redis server. It moves bytes and says what happened; the tracker decides.

One file per chunk and rank, ``<chunk key hex>.<rank>.kvl2``, holding the value the worker
sealed (``connector/values.py``: a header binding it to its chunk key, rank and KV layout,
with its checksums, then the payload), so a torn, damaged or swapped file is refused (the
worker checks it: ``length``, ``checksum``, ``misplaced``, ...), never loaded. A file is written under a temporary name in the same directory and published by
``os.replace``: a reader sees a whole file or none. Not fsynced: this is a cache, and a
file the machine lost in a crash fails its checksum or is gone, a recorded miss.

Failures: a file that is not there is ``missing``; one that cannot be read or written (a
permission, a full disk) fails that chunk alone, ``refused: <error>``; a directory that is
gone or not a directory is an outage (``TierUnavailable``), which the scheduler side records
once and probes each step (``check``) until the directory serves again.

At startup the directory named is made, never its parents. One whose parent is not there yet
(a mount not up) is an outage, as a Redis server down at startup is: the connector starts,
the scheduler records it, and each probe tries to make the directory again, so the tier
comes up by itself once the parent is there. What no wait mends is a configuration error
(``ConnectorConfigError`` naming ``remote_url``): a path that is a file, a directory that
cannot be made (a permission) or that exists and cannot be written.

Nothing evicts: the directory grows until the filesystem is full (each write then fails,
recorded). Delete files whenever you like (by age, say: ``find DIR -name '*.kvl' -mmin +60
-delete``): a chunk gone is a recorded miss that vLLM recomputes.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from kvledger.connector.config import ConnectorConfig, ConnectorConfigError, redacted, url_path
from kvledger.connector.remote import describe
from kvledger.connector.tiers import MISSING, REFUSED, TierUnavailable

if TYPE_CHECKING:
    from kvledger.connector.values import Sealed

__all__ = ["DiskTier", "chunk_file"]

_SUFFIX = ".kvl2"  # the value format (files of the earlier one, .kvl, are never read)


def chunk_file(key: bytes, rank: int) -> str:
    """The file name of chunk ``key``'s share of worker ``rank``."""
    return f"{key.hex()}.{rank}{_SUFFIX}"


def _directory(url: str) -> str:
    """The directory of a ``file://`` URL: an absolute path, no host but ``localhost``, no
    query or fragment; else ``ConnectorConfigError`` naming ``remote_url``."""
    try:
        parts = urlsplit(url)
    except ValueError:  # an unclosed [ of an IPv6 host
        parts = urlsplit("-:")  # no file:// URL: refused below
    if parts.scheme != "file" or parts.netloc not in ("", "localhost"):
        raise ConnectorConfigError(
            f"remote_url must be file:///absolute/path/to/dir for the disk tier: {redacted(url)}"
        )
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        raise ConnectorConfigError(
            f"remote_url file:// takes no query or fragment: {redacted(url)}"
        )
    path = url_path(url, "file:// path")  # UTF-8, no control character: else refused
    if ".." in path.split("/"):
        # Normalising /srv/x/../../etc/kvl would make and fill /etc/kvl, a directory the
        # URL does not plainly name.
        raise ConnectorConfigError(
            "remote_url file:// may not have .. in its path: name the directory plainly "
            f"(file:///srv/kvl): {redacted(url)}"
        )
    # Judged after normalising: /., /./ and // all name / itself.
    normal = os.path.normpath(path)
    if not path.startswith("/") or normal.strip("/") == "":
        raise ConnectorConfigError(
            f"remote_url file:// must name an absolute directory other than /: {redacted(url)}"
        )
    return normal


class DiskTier:
    """The chunks of one directory; see the module's docstring. Its calls raise
    ``TierUnavailable`` (the directory does not serve) and nothing else."""

    name = "file"

    def __init__(self, url: str, *, rank: int = 0) -> None:
        self.url = url
        self.rank = rank
        self.directory = _directory(url)
        # Until the directory has been there once, check() makes it when its parent is there.
        # After, a directory gone is an outage until someone puts it back: it may have been
        # removed on purpose, or a mount gone would have us write under its mount point.
        self._there = False

    def __repr__(self) -> str:
        return f"DiskTier({self.directory!r}, rank={self.rank})"

    @classmethod
    def from_config(cls, config: ConnectorConfig, *, rank: int = 0, scheduler: bool) -> DiskTier:
        assert config.remote_url is not None
        tier = cls(config.remote_url, rank=rank)
        tier._make(startup=True)  # a parent not there yet: the sides' check says so
        return tier

    def _make(self, *, startup: bool) -> str | None:
        """Make the directory named, never its parents: None once it is there, else why not
        (``Type: message``). A parent not there is only that (a mount not up yet); at
        ``startup``, anything else raises ``ConnectorConfigError``: no wait mends it."""
        try:
            os.mkdir(self.directory)
        except FileExistsError:
            if os.path.isdir(self.directory):
                self._there = True
                return None
            why = f"NotADirectoryError: {self.directory} is not a directory"
        except FileNotFoundError:
            parent = os.path.dirname(self.directory)
            return f"FileNotFoundError: {self.directory} cannot be made: {parent} is not there"
        except OSError as exc:
            why = f"the directory cannot be made: {describe(exc)}"
        else:
            self._there = True
            return None
        if startup:
            raise ConnectorConfigError(f"remote_url {redacted(self.url)}: {why}")
        return why

    def _path(self, key: bytes) -> str:
        return os.path.join(self.directory, chunk_file(key, self.rank))

    def _serving(self) -> None:
        if not os.path.isdir(self.directory):
            raise TierUnavailable(f"NotADirectoryError: {self.directory} is not a directory")

    def available(self) -> bool:
        return True  # a local call: asked each time, no back-off

    def check(self, *, startup: bool = False) -> str | None:
        """None if the directory is there and this process may read and write in it. Until
        it has been there once, it is made here (see the module's docstring)."""
        if not self._there:
            why = self._make(startup=startup)
            if why is not None:
                return why
        try:
            self._serving()
        except TierUnavailable as exc:
            return str(exc)
        if not os.access(self.directory, os.R_OK | os.W_OK | os.X_OK):
            why = f"PermissionError: {self.directory} is not readable and writable"
            if startup:
                raise ConnectorConfigError(f"remote_url {redacted(self.url)}: {why}")
            return why
        return None

    def check_chunk_bytes(self, chunk_bytes: int) -> None:
        pass  # a file holds any chunk

    def describe(self, exc: BaseException) -> str:
        return describe(exc)

    def exists(self, keys: Sequence[bytes]) -> list[int]:
        self._serving()
        return [1 if os.path.isfile(self._path(key)) else 0 for key in keys]

    def get(self, keys: Sequence[bytes]) -> list[bytes | memoryview | str]:
        self._serving()
        out: list[bytes | memoryview | str] = []
        for key in keys:
            try:
                with open(self._path(key), "rb") as f:
                    value = f.read()
            except FileNotFoundError:
                out.append(MISSING)
                continue
            except OSError as exc:
                out.append(f"{REFUSED}: {describe(exc)}")
                continue
            out.append(value)
        return out

    def put(self, items: Sequence[tuple[bytes, Sealed]]) -> list[str | None]:
        self._serving()
        return [self._put_one(key, value) for key, value in items]

    def _put_one(self, key: bytes, value: Sealed) -> str | None:
        final = self._path(key)
        temp = f"{final}.tmp.{os.getpid()}.{os.urandom(4).hex()}"
        try:
            with open(temp, "wb") as f:
                f.write(value.head())
                f.write(value.payload)
            os.replace(temp, final)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            return f"{REFUSED}: {describe(exc)}"
        return None

    def close(self) -> None:
        pass  # no file stays open
