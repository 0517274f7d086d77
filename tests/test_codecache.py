"""The on-disk code cache (engine/codecache.py) under hostile file systems: read-only
directories, things that are not regular files where entries should be, a cache root that is
a file.  A cache problem must never break compilation: at worst the cache is skipped and the
reason counted in ``stats``.  No GPU or compiler needed.
"""
import errno
import os
import stat
import tempfile
import threading

import pytest

from engine import codecache

KEY = {"source": "x", "arch": "gfx906", "compiler": "test", "options": ["-O3"]}


class Builder:
    def __init__(self, payload=b"payload"):
        self.payload, self.calls = payload, 0

    def __call__(self):
        self.calls += 1
        return self.payload


def erofs(*args, **kwargs):
    raise OSError(errno.EROFS, os.strerror(errno.EROFS))


def run_bounded(fn, timeout=20.0):
    """fn() in a daemon thread; fails the test (instead of hanging it) if fn blocks."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:                     # reported in the caller's thread
            box["error"] = e
    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"blocked for more than {timeout} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def corrupt(path):
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 0xFF
    path.write_bytes(bytes(blob))


# ----------------------------------------------------------------------------- (1) read-only
def test_corrupt_entry_in_read_only_dir(tmp_path, monkeypatch):
    cache = codecache.CodeCache(tmp_path)
    cache.put(KEY, b"payload")
    path = cache.path(KEY)
    corrupt(path)
    bad = path.read_bytes()
    for d in (path.parent, path.parent.parent, tmp_path):
        d.chmod(0o555)
    # As root chmod does not stop writes: make every way of changing the directory fail as a
    # read-only file system would.
    monkeypatch.setattr(codecache.os, "unlink", erofs)
    monkeypatch.setattr(codecache.os, "rmdir", erofs)
    monkeypatch.setattr(codecache.os, "replace", erofs)
    monkeypatch.setattr(codecache.tempfile, "mkstemp", erofs)
    try:
        build = Builder()
        assert cache.get_or_build(KEY, build) == (b"payload", False)
        assert cache.get_or_build(KEY, build) == (b"payload", False)     # still no cache, still fine
    finally:
        monkeypatch.undo()
        for d in (tmp_path, path.parent.parent, path.parent):
            d.chmod(0o755)
    assert build.calls == 2
    assert cache.stats == {"hits": 0, "misses": 2, "corrupt": 2, "read_errors": 0, "write_errors": 2}
    assert "Read-only file system" in cache.last_error
    assert path.read_bytes() == bad                                     # left as it was
    # Writable again: the next use replaces the corrupt entry.
    assert cache.get_or_build(KEY, build) == (b"payload", False)
    assert cache.get_or_build(KEY, build) == (b"payload", True)


def test_read_only_dir_via_chmod(tmp_path):
    cache = codecache.CodeCache(tmp_path)
    cache.put(KEY, b"payload")
    path = cache.path(KEY)
    corrupt(path)
    path.parent.chmod(0o555)
    try:
        probe = path.parent / "probe"
        try:
            probe.write_bytes(b"")
        except PermissionError:
            pass
        else:
            probe.unlink()
            pytest.skip("chmod does not stop writes here (root)")
        build = Builder()
        assert cache.get_or_build(KEY, build) == (b"payload", False)
        assert cache.stats["corrupt"] == 1 and cache.stats["write_errors"] == 1
        assert not list(path.parent.glob("*.tmp"))
    finally:
        path.parent.chmod(0o755)


def test_unreadable_entry_is_a_miss(tmp_path, monkeypatch):
    cache = codecache.CodeCache(tmp_path)
    cache.put(KEY, b"payload")
    real_open = os.open

    def no_read(path, flags, *a, **k):
        if str(path) == str(cache.path(KEY)):
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_open(path, flags, *a, **k)
    monkeypatch.setattr(codecache.os, "open", no_read)
    build = Builder()
    assert cache.get_or_build(KEY, build) == (b"payload", False)
    assert cache.stats["read_errors"] == 1 and cache.stats["write_errors"] == 0
    assert "Permission denied" in cache.last_error


def test_failed_replace_leaves_no_temp_file(tmp_path, monkeypatch):
    cache = codecache.CodeCache(tmp_path)
    monkeypatch.setattr(codecache.os, "replace", erofs)
    assert cache.get_or_build(KEY, Builder()) == (b"payload", False)
    assert cache.stats["write_errors"] == 1
    assert not list(tmp_path.rglob("*.tmp"))


# ----------------------------------------------------------------------------- (2) directory
def test_entry_that_is_an_empty_directory_is_replaced(tmp_path):
    cache = codecache.CodeCache(tmp_path)
    path = cache.path(KEY)
    path.mkdir(parents=True)
    build = Builder()
    assert cache.get_or_build(KEY, build) == (b"payload", False)
    assert cache.stats["corrupt"] == 1 and cache.stats["write_errors"] == 0
    assert path.is_file()
    assert cache.get_or_build(KEY, build) == (b"payload", True)


def test_entry_that_is_a_non_empty_directory_is_skipped(tmp_path):
    cache = codecache.CodeCache(tmp_path)
    path = cache.path(KEY)
    path.mkdir(parents=True)
    (path / "keep").write_bytes(b"not ours")
    build = Builder()
    for _ in range(2):
        assert cache.get_or_build(KEY, build) == (b"payload", False)
    assert build.calls == 2
    assert cache.stats == {"hits": 0, "misses": 2, "corrupt": 2, "read_errors": 0, "write_errors": 2}
    assert (path / "keep").read_bytes() == b"not ours"                  # never removed
    assert not list(path.parent.glob("*.tmp"))


# ----------------------------------------------------------------------------- (3) root is a file
def test_cache_dir_that_is_a_regular_file(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    root.write_bytes(b"a file")
    monkeypatch.setenv("VEGAFUSE_CACHE_DIR", str(root))
    cache = codecache.CodeCache()
    assert cache.root == root
    assert cache.get(KEY) is None
    build = Builder()
    assert cache.get_or_build(KEY, build) == (b"payload", False)
    assert cache.stats["read_errors"] == 2 and cache.stats["write_errors"] == 1
    assert "NotADirectoryError" in cache.last_error or "FileExistsError" in cache.last_error
    assert root.read_bytes() == b"a file"
    with pytest.raises(OSError):                                         # put itself still says so
        cache.put(KEY, b"payload")


# ----------------------------------------------------------------------------- (4) FIFO etc.
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_entry_that_is_a_fifo_does_not_block(tmp_path):
    cache = codecache.CodeCache(tmp_path)
    path = cache.path(KEY)
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    build = Builder()
    assert run_bounded(lambda: cache.get_or_build(KEY, build)) == (b"payload", False)
    assert cache.stats["corrupt"] == 1 and cache.stats["write_errors"] == 0
    assert stat.S_ISREG(os.lstat(path).st_mode)
    assert cache.get_or_build(KEY, build) == (b"payload", True)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_fifo_in_read_only_dir_does_not_block(tmp_path, monkeypatch):
    cache = codecache.CodeCache(tmp_path)
    path = cache.path(KEY)
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    monkeypatch.setattr(codecache.os, "unlink", erofs)
    monkeypatch.setattr(codecache.tempfile, "mkstemp", erofs)
    build = Builder()
    for _ in range(2):
        assert run_bounded(lambda: cache.get_or_build(KEY, build)) == (b"payload", False)
    monkeypatch.undo()
    assert stat.S_ISFIFO(os.lstat(path).st_mode)
    assert cache.stats == {"hits": 0, "misses": 2, "corrupt": 2, "read_errors": 0, "write_errors": 2}


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_symlink_to_fifo_does_not_block(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    cache = codecache.CodeCache(tmp_path / "cache")
    path = cache.path(KEY)
    path.parent.mkdir(parents=True)
    path.symlink_to(fifo)
    build = Builder()
    assert run_bounded(lambda: cache.get_or_build(KEY, build)) == (b"payload", False)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)                         # the target is untouched
    assert cache.get_or_build(KEY, build) == (b"payload", True)


# ----------------------------------------------------------------------------- concurrency
def test_bad_entry_replaced_meanwhile_is_not_deleted(tmp_path):
    """A reader that found a corrupt entry must not delete a good one another process has
    stored at the same path since."""
    cache = codecache.CodeCache(tmp_path)
    cache.put(KEY, b"old")
    path = cache.path(KEY)
    seen = os.stat(path)
    other = codecache.CodeCache(tmp_path)
    other.put(KEY, b"new")                                               # a fresh inode
    cache._discard(path, seen)
    assert codecache.CodeCache(tmp_path).get(KEY) == b"new"


def test_no_home_falls_back_to_temp(monkeypatch):
    monkeypatch.delenv("VEGAFUSE_CACHE_DIR", raising=False)

    def no_home():
        raise RuntimeError("Could not determine home directory.")
    monkeypatch.setattr(codecache.Path, "home", staticmethod(no_home))
    root = codecache.default_cache_dir()
    assert root.parent == codecache.Path(tempfile.gettempdir())
