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
as a miss: it is deleted and rebuilt (``stats["corrupt"]`` counts these).

Concurrency: writes go to a temp file in the same directory, are fsync'ed and
then ``os.replace``-d into place, which is atomic on POSIX.  A reader therefore
sees either no entry or a whole one.  Two processes that miss the same key at
the same time both build and both write; the later rename wins and, as builds
are deterministic, both files are the same.  No locks are taken.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from pathlib import Path

MAGIC = b"VFCODE1\n"
_HEADER = struct.Struct("<8sQ32s")            # magic, payload length, payload sha256


def default_cache_dir() -> Path:
    """``$VEGAFUSE_CACHE_DIR`` if set, else ``~/.cache/vegafuse``."""
    env = os.environ.get("VEGAFUSE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "vegafuse"


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

    ``stats``: this instance's counts of ``hits``, ``misses`` (each miss runs
    ``build`` once), ``corrupt`` (entries found damaged, deleted and rebuilt)
    and ``write_errors`` (entries that could not be stored; the build result is
    still returned).
    """

    def __init__(self, root: str | os.PathLike | None = None):
        self.root = Path(root) if root is not None else default_cache_dir()
        self.stats = {"hits": 0, "misses": 0, "corrupt": 0, "write_errors": 0}

    def path(self, key_parts: dict) -> Path:
        """Where the entry for ``key_parts`` lives (whether or not it exists)."""
        h = cache_key(key_parts)
        return self.root / "objects" / h[:2] / f"{h}.bin"

    def get(self, key_parts: dict) -> bytes | None:
        """The cached payload, or None (absent, or corrupt: then the entry is deleted)."""
        path = self.path(key_parts)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return None
        payload = unpack_entry(blob)
        if payload is None:
            self.stats["corrupt"] += 1
            try:
                path.unlink()
            except FileNotFoundError:
                pass                                  # another process got there first
        return payload

    def put(self, key_parts: dict, payload: bytes) -> Path:
        """Store ``payload`` atomically (temp file in the same directory, fsync, ``os.replace``)."""
        path = self.path(key_parts)
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
            except FileNotFoundError:
                pass
            raise
        return path

    def get_or_build(self, key_parts: dict, build) -> tuple[bytes, bool]:
        """``(payload, hit)``: the cached payload, or ``build()`` (-> bytes) stored and returned.

        A failing ``build`` raises through and stores nothing.  A failing store
        (read-only or full disk) is counted in ``stats["write_errors"]`` and ignored.
        """
        payload = self.get(key_parts)
        if payload is not None:
            self.stats["hits"] += 1
            return payload, True
        self.stats["misses"] += 1
        payload = bytes(build())
        try:
            self.put(key_parts, payload)
        except OSError:
            self.stats["write_errors"] += 1
        return payload, False
