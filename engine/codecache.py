"""On-disk cache of compiled code objects (GPU binaries), shared by processes.

Usage::

    cache = CodeCache()                        # $VEGAFUSE_CACHE_DIR or ~/.cache/vegafuse
    code, hit = cache.get_or_build({"source": src, "arch": "gfx906",
                                    "compiler": "hiprtc 5.2 ...", "options": ["-O3"]},
                                   lambda: compile_somehow(src))

Key: sha256 of the key parts (a dict of str / int / list values, serialized as
canonical JSON), so any change of source, target, compiler identity or options
is a different entry.

Layout: ``ROOT/objects/ab/abcdef....bin`` (two-hex-digit fan-out).  An entry is
a 48-byte header followed by the payload::

    0   8  magic  b"VFCODE1\\n"
    8   8  payload length in bytes (little-endian u64)
    16 32  sha256 of the payload

A read checks all three; a short, truncated or otherwise corrupt entry counts
as a miss: it is deleted and rebuilt (``stats["corrupt"]`` counts these), and one line
``warning: ...`` on stderr names it.  So
does an entry that is not a regular file (a directory, FIFO, device, ...): it
is opened with ``O_NONBLOCK`` and checked with ``fstat`` before any read, so a
FIFO never blocks; it is removed if it can be (a directory only if empty).

Failures: the cache never breaks the caller.  An entry that cannot be read
(permissions, I/O error, the cache root being a regular file, ...) is a miss
counted in ``stats["read_errors"]``; an entry that cannot be stored (read-only
or full disk, a directory in the way, ...) is skipped and counted in
``stats["write_errors"]``; a corrupt entry that cannot be deleted is left for
the next write to replace.  The last such problem is kept, as text, in
``CodeCache.last_error``.

Off: ``CodeCache(enabled=False)`` (what :func:`engine.build.code_cache` gives under
``VEGAFUSE_CACHE=0``) reads nothing and writes nothing, so every caller builds: a cold start on
every run, for A/B measurements.

Concurrency: writes go to a temp file in the same directory, are fsync'ed and
then ``os.replace``-d into place, which is atomic on POSIX.  A reader therefore
sees either no entry or a whole one.  Two processes that miss the same key at
the same time both build and both write; the later rename wins and, as builds
are deterministic, both files are the same.  No file locks are taken; threads
may share an instance (only ``stats`` is guarded, by a lock).
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
import sys
import tempfile
import threading
from pathlib import Path

MAGIC = b"VFCODE1\n"
_HEADER = struct.Struct("<8sQ32s")            # magic, payload length, payload sha256


_WARN_LOCK = threading.Lock()


def warn(line: str) -> None:
    """Print ``warning: line`` on stderr as one whole line (builds run on several threads)."""
    with _WARN_LOCK:
        sys.stderr.write(f"warning: {line}\n")
        sys.stderr.flush()


def default_cache_dir() -> Path:
    """``$VEGAFUSE_CACHE_DIR`` if set, else ``~/.cache/vegafuse``."""
    env = os.environ.get("VEGAFUSE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    try:
        return Path.home() / ".cache" / "vegafuse"
    except (RuntimeError, KeyError):                # no $HOME and no passwd entry
        return Path(tempfile.gettempdir()) / f"vegafuse-{os.getuid()}"


def cache_key(key_parts: dict) -> str:
    """Hex sha256 of the key parts (canonical JSON: sorted keys, lists for tuples)."""
    text = json.dumps(key_parts, sort_keys=True, separators=(",", ":"), default=list)
    return hashlib.sha256(text.encode()).hexdigest()


def pack_entry(payload: bytes) -> bytes:
    return _HEADER.pack(MAGIC, len(payload), hashlib.sha256(payload).digest()) + payload


def unpack_entry(blob: bytes) -> bytes | None:
    """The payload of a cache entry, or None if it is truncated or corrupt."""
    if len(blob) < _HEADER.size:
        return None
    magic, length, digest = _HEADER.unpack_from(blob)
    payload = blob[_HEADER.size:]
    if magic != MAGIC or length != len(payload) or hashlib.sha256(payload).digest() != digest:
        return None
    return payload


class CodeCache:
    """Code objects on disk under ``root`` (default: :func:`default_cache_dir`).

    ``enabled=False``: a cache that holds nothing (every lookup misses, nothing is stored).
    ``stats``: this instance's counts of ``hits``, ``misses`` (each miss runs
    ``build`` once), ``corrupt`` (entries found damaged or not a regular file;
    deleted where possible and rebuilt), ``read_errors`` (entries that could not
    be read: treated as misses) and ``write_errors`` (entries that could not be
    stored; the build result is still returned).  ``last_error``: a line on the
    latest read, delete or write problem, or None.
    """

    # Read no more than this from an entry (a code object is a few MB at most).
    MAX_ENTRY_BYTES = 1 << 30

    def __init__(self, root: str | os.PathLike | None = None, enabled: bool = True):
        self.root = Path(root) if root is not None else default_cache_dir()
        self.enabled = enabled
        self.stats = {"hits": 0, "misses": 0, "corrupt": 0, "read_errors": 0, "write_errors": 0}
        self.last_error: str | None = None
        self._lock = threading.Lock()                 # builds may run on several threads

    def _count(self, what: str) -> None:
        with self._lock:
            self.stats[what] += 1

    def _note(self, what: str, path, err: BaseException) -> None:
        self.last_error = f"{what} {path}: {type(err).__name__}: {err}"

    def path(self, key_parts: dict) -> Path:
        """Where the entry for ``key_parts`` lives (whether or not it exists)."""
        h = cache_key(key_parts)
        return self.root / "objects" / h[:2] / f"{h}.bin"

    def get(self, key_parts: dict) -> bytes | None:
        """The cached payload, or None: absent, unreadable (``stats["read_errors"]``), or
        corrupt / not a regular file (``stats["corrupt"]``; the entry is then deleted if it
        can be).  Never raises OSError and never blocks on a FIFO or device."""
        if not self.enabled:
            return None
        path = self.path(key_parts)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            return None
        except IsADirectoryError:                     # platforms that refuse to open a directory
            self._corrupt(path, None)
            return None
        except OSError as e:
            self._count("read_errors")
            self._note("read", path, e)
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                self._corrupt(path, st)
                return None
            blob = self._read_all(fd, min(st.st_size, self.MAX_ENTRY_BYTES) + 1)
        except OSError as e:
            self._count("read_errors")
            self._note("read", path, e)
            return None
        finally:
            os.close(fd)
        payload = unpack_entry(blob) if len(blob) <= self.MAX_ENTRY_BYTES else None
        if payload is None:
            self._corrupt(path, st)
        return payload

    def _corrupt(self, path: Path, seen: os.stat_result | None) -> None:
        """A damaged entry (or not a regular file): counted, named in one warning line, removed."""
        self._count("corrupt")
        warn(f"damaged cache entry {path} (not a whole entry); removed and built again")
        self._discard(path, seen)

    @staticmethod
    def _read_all(fd: int, limit: int) -> bytes:
        chunks, n = [], 0
        while n < limit:
            chunk = os.read(fd, min(limit - n, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            n += len(chunk)
        return b"".join(chunks)

    def _discard(self, path: Path, seen: os.stat_result | None) -> None:
        """Remove a bad entry, best effort.  ``seen``: the stat of what was read; if the path
        now names something else (another process stored a fresh entry), it is left alone."""
        try:
            now = os.lstat(path)
            if seen is not None and (now.st_dev, now.st_ino) != (seen.st_dev, seen.st_ino):
                return
            if stat.S_ISDIR(now.st_mode):
                os.rmdir(path)                        # only if empty; never a tree
            else:
                os.unlink(path)
        except FileNotFoundError:
            pass                                      # another process got there first
        except OSError as e:                          # read-only dir, non-empty directory, ...
            self._note("delete", path, e)

    def put(self, key_parts: dict, payload: bytes) -> Path:
        """Store ``payload`` atomically (temp file in the same directory, fsync, ``os.replace``).

        Raises OSError if it cannot (:meth:`get_or_build` counts and ignores that); no temp
        file is left behind.  A disabled cache stores nothing."""
        path = self.path(key_parts)
        if not self.enabled:
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(pack_entry(payload))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return path

    def get_or_build(self, key_parts: dict, build) -> tuple[bytes, bool]:
        """``(payload, hit)``: the cached payload, or ``build()`` (-> bytes) stored and returned.

        A failing ``build`` raises through and stores nothing.  A failing read is a miss
        (``stats["read_errors"]``); a failing store (read-only or full disk, a directory in
        the way, the cache root not a directory, ...) is counted in ``stats["write_errors"]``
        and ignored.
        """
        payload = self.get(key_parts)
        if payload is not None:
            self._count("hits")
            return payload, True
        self._count("misses")
        payload = bytes(build())
        try:
            self.put(key_parts, payload)
        except OSError as e:
            self._count("write_errors")
            self._note("write", self.path(key_parts), e)
        return payload, False
