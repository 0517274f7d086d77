"""What ``--model`` names, and the models found on this machine.

``--model`` takes a GGUF file, a Hugging Face model directory, or the id of a Hugging Face repo
(``ORG/NAME``, or ``ORG/NAME/FILE.gguf`` for one file of a GGUF repo) already in the local Hugging
Face cache: it is looked up offline and never downloaded.  ``python -m engine.models`` lists the
default model and the supported models in that cache.
"""
from __future__ import annotations

import json
import os
import re
import stat
import sys

from .errors import ModelError, Parser, run_cli

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(/[^/].*)?")


def check_path(path: str) -> str:
    """``path`` itself when it is a directory or a regular file (a symbolic link is followed).

    Raises:
        ModelError: it is something else (a FIFO, socket or device would block or fail when read),
            or it cannot be examined; the type is checked without opening it."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise ModelError(f"{path}: cannot read it ({e.strerror}); pass a .gguf file or a Hugging Face "
                         "model directory") from None
    if stat.S_ISDIR(mode) or stat.S_ISREG(mode):
        return path
    kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
    raise ModelError(f"{path}: is {kind}, not a model file; pass a .gguf file or a Hugging Face "
                     "model directory")


def hf_cache_dir() -> str:
    """The Hugging Face hub cache this machine uses ($HF_HUB_CACHE, else $HF_HOME/hub, else
    ~/.cache/huggingface/hub), as ``huggingface_hub`` resolves it."""
    from huggingface_hub import constants
    return constants.HF_HUB_CACHE


def _snapshots(cache_dir=None):
    """{repo id: snapshot directory} of the model repos in the cache: the revision ``main`` points
    at, else the newest.  {} when there is no cache."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound
    try:
        info = scan_cache_dir(cache_dir or hf_cache_dir())
    except CacheNotFound:
        return {}
    out = {}
    for repo in info.repos:
        if repo.repo_type == "model" and repo.revisions:
            rev = max(repo.revisions, key=lambda r: ("main" in r.refs, r.last_modified))
            out[repo.repo_id] = str(rev.snapshot_path)
    return out


def find_cached(spec: str, cache_dir=None) -> str | None:
    """The local path of Hugging Face repo id ``spec`` (``ORG/NAME`` or ``ORG/NAME/FILE``) in the
    cache, offline: the snapshot directory when it holds ``config.json``, else its one ``.gguf``
    file, else the named file.  None when ``spec`` is not in the cache (or not a repo id).

    Raises:
        ModelError: the repo holds several GGUF files (names them), or neither a config.json nor
            a GGUF file, or not the named file."""
    if not _REPO_ID.fullmatch(spec):
        return None
    parts = spec.split("/", 2)
    repo_id, rest = "/".join(parts[:2]), parts[2] if len(parts) > 2 else None
    snaps = _snapshots(cache_dir)
    snap = snaps.get(repo_id) or next((p for r, p in snaps.items() if r.lower() == repo_id.lower()), None)
    if snap is None:
        return None
    if rest is not None:
        path = os.path.join(snap, rest)
        if not os.path.exists(path):
            raise ModelError(f"{spec}: the cached repo {repo_id} has no file {rest}; its files: "
                             f"{', '.join(sorted(os.listdir(snap)))}")
        return check_path(path)
    if os.path.isfile(os.path.join(snap, "config.json")):
        return snap
    ggufs = sorted(f for f in os.listdir(snap) if f.endswith(".gguf"))
    if len(ggufs) == 1:
        return os.path.join(snap, ggufs[0])
    if ggufs:
        raise ModelError(f"{spec}: the cached repo holds {len(ggufs)} GGUF files; pick one, e.g. "
                         f"--model {repo_id}/{ggufs[0]} (others: {', '.join(ggufs[1:])})")
    raise ModelError(f"{spec}: the cached repo holds neither config.json nor a .gguf file; "
                     "download the model's files with: hf download " + repo_id)


def resolve_model(spec: str | None, cache_dir=None) -> str:
    """The path ``engine.weights.load_model`` takes for ``--model spec``: the default model when
    None, an existing file or directory as it is (checked to be one, without opening it), else the
    Hugging Face repo id found in the local cache (:func:`find_cached`).

    Raises:
        ModelError: none of these, or a path that is not a regular file or directory."""
    if spec is None:
        from .weights import default_model_path
        return default_model_path()
    if os.path.lexists(spec):
        return check_path(spec)
    found = find_cached(spec, cache_dir) if _REPO_ID.fullmatch(spec) else None
    if found is None:
        where = f", nor a Hugging Face repo id in the local cache {cache_dir or hf_cache_dir()}" \
            if _REPO_ID.fullmatch(spec) else ""
        raise ModelError(f"{spec}: no such file or directory{where}; pass a .gguf file, a Hugging Face "
                         "model directory or the id of a downloaded repo (python -m engine.models lists them)")
    return found


def _arch(path: str) -> str | None:
    """The architecture of a GGUF file or Hugging Face directory (None when unreadable)."""
    from .weights import _HF_CLASSES, _GGUFFile
    try:
        if os.path.isdir(path):
            with open(os.path.join(path, "config.json"), encoding="utf-8") as fh:
                cfg = json.load(fh)
            by_class = {v: k for k, v in _HF_CLASSES.items()}
            found = [by_class[a] for a in cfg.get("architectures") or [] if a in by_class]
            return cfg.get("model_type") if cfg.get("model_type") in _HF_CLASSES else (found or [None])[0]
        arch = _GGUFFile(path).fields["general.architecture"].raw
        return arch.decode() if isinstance(arch, bytes) else arch
    except Exception:
        return None


def _size(path: str) -> int:
    if not os.path.isdir(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
               if f.endswith(".safetensors"))


def local_models(cache_dir=None) -> list[tuple[str, str, str, int]]:
    """The supported models in the local Hugging Face cache: (the ``--model`` value, architecture,
    path, weight bytes), sorted.  A GGUF repo lists each of its ``.gguf`` files."""
    from .weights import SUPPORTED_ARCHS
    out = []
    for repo_id, snap in sorted(_snapshots(cache_dir).items()):
        if os.path.isfile(os.path.join(snap, "config.json")):
            cands = [(repo_id, snap)]
        else:
            ggufs = sorted(f for f in os.listdir(snap) if f.endswith(".gguf"))
            cands = [(repo_id if len(ggufs) == 1 else f"{repo_id}/{g}", os.path.join(snap, g)) for g in ggufs]
        for spec, path in cands:
            arch = _arch(path)
            if arch in SUPPORTED_ARCHS:
                out.append((spec, arch, path, _size(path)))
    return out


def main(argv=None):
    """``python -m engine.models``: print the default model and the supported cached ones; returns 0."""
    p = Parser("engine.models", "List the default model and the supported models in the local "
                                "Hugging Face cache (what --model takes).")
    return run_cli(_list, p.parse_args(argv))


def _list(args):
    from .weights import default_model_path
    try:
        path = default_model_path()
        print(f"default model: {path} ({_size(path) / 1e6:.1f} MB)")
    except ModelError as e:
        print(f"default model: not installed ({e})")
    models = local_models()
    print(f"in the Hugging Face cache {hf_cache_dir()}: {len(models) or 'no'} supported models"
          f"{':' if models else ' (llama, mistral, qwen2; download one with: hf download ORG/NAME)'}")
    for spec, arch, _, size in models:
        print(f"  --model {spec:<60} {arch:<8} {size / 1e6:9.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
