"""Start-up: a warm process renders and compiles nothing (counted, in fresh processes), damaged
cache entries are rebuilt with one warning line, the cache switches, a GPU backend that is not
there fails in one line before anything loads, the statistics line, progress only on a terminal,
and ./run's set-up that costs nothing once done."""
import json
import os
import pty
import re
import resource
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import dsl
from engine.devices.probe import why_not
from tests.test_pipeline import block
from tests.test_weights import tiny_hf_weights, write_tiny_gguf

REPO = Path(__file__).resolve().parent.parent

# generate (the CLI's main) in a fresh process; the process's build counts as the last stderr line
GENERATE = r"""
import json, sys
from engine import build, generate
rc = generate.main(sys.argv[1:])
print(json.dumps(build.COUNTS), file=sys.stderr)
sys.exit(rc)
"""

# the DSL block on the CPU in a fresh process, inputs from an .npz, the result to another
BLOCK = r"""
import json, sys
import numpy as np
import dsl
from engine import build
from tests.test_pipeline import block
a = np.load(sys.argv[1])
y = dsl.jit(block, backend="cpu")(a["x"], a["g"], a["w"], a["r"])
np.save(sys.argv[2], np.asarray(y))
print(json.dumps(build.COUNTS))
"""


def child(code, *args, cache, **env):
    e = dict(os.environ, VEGAFUSE_CACHE_DIR=str(cache), VEGAFUSE_DEBUG="0", **env)
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=REPO, env=e, capture_output=True,
                          text=True, timeout=600)


def generate(model, cache, **env):
    r = child(GENERATE, "--model", model, "--temperature", "0", "--max-tokens", "4", "--json", "ab c",
              cache=cache, **env)
    assert r.returncode == 0, r.stderr
    lines = r.stderr.strip().splitlines()
    return json.loads(r.stdout)["ids"], json.loads(lines[-1]), lines[:-1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", tiny_hf_weights())


def test_a_warm_process_renders_and_compiles_nothing(tiny, tmp_path):
    ids, cold, lines = generate(tiny, tmp_path)
    assert cold["compiles"] >= 2 and cold["renders"] >= 1 and cold["cached"] == 0
    assert any(f"{cold['compiles']} objects compiled, 0 from the cache" in x for x in lines), lines
    warm_ids, warm, lines = generate(tiny, tmp_path)
    assert warm == {"renders": 0, "compiles": 0, "cached": cold["compiles"]}
    assert any(f"0 objects compiled, {cold['compiles']} from the cache" in x for x in lines), lines
    assert warm_ids == ids and len(ids) >= 1


def test_code_read_back_from_the_cache_computes_the_block(tmp_path):
    rng = np.random.default_rng()
    args = {"x": rng.standard_normal((1, 64)).astype("f4"), "g": rng.standard_normal(64).astype("f4"),
            "w": rng.standard_normal((48, 64)).astype("f2"), "r": rng.standard_normal((1, 48)).astype("f4")}
    np.savez(tmp_path / "in.npz", **args)
    counts = []
    for run in ("cold", "warm"):
        r = child(BLOCK, tmp_path / "in.npz", tmp_path / f"{run}.npy", cache=tmp_path / "cache")
        assert r.returncode == 0, r.stderr
        counts.append(json.loads(r.stdout))
    assert counts[0]["compiles"] >= 1 and counts[1]["compiles"] == counts[1]["renders"] == 0
    leaves = [args[k] for k in "xgwr"]
    want = dsl.jit(block).lower(*leaves).program.run(*leaves, compute_dtype="f64")[0]
    for run in ("cold", "warm"):
        np.testing.assert_allclose(np.load(tmp_path / f"{run}.npy"), want, rtol=2e-3, atol=2e-3)


def test_damaged_entries_are_rebuilt_with_one_warning_line_each(tiny, tmp_path):
    ids, cold, _ = generate(tiny, tmp_path)
    entries = sorted((tmp_path / "objects").glob("*/*.bin"))
    for i, path in enumerate(entries):
        blob = path.read_bytes()
        path.write_bytes(blob[:len(blob) // 2] if i % 2 else blob[:40] + b"\0" * 8 + blob[48:])
    again, counts, lines = generate(tiny, tmp_path)
    warnings = [x for x in lines if x.startswith("warning: ")]
    assert len(warnings) == len(entries) and all("damaged cache entry" in x for x in warnings), lines
    assert counts["compiles"] == cold["compiles"] and again == ids
    third, counts, lines = generate(tiny, tmp_path)
    assert counts["compiles"] == counts["renders"] == 0 and third == ids
    assert not any(x.startswith("warning: ") for x in lines)


def test_switches_cache_off_and_render_again(tiny, tmp_path):
    ids, cold, _ = generate(tiny, tmp_path / "off", VEGAFUSE_CACHE="0")
    assert not (tmp_path / "off").exists()                                 # nothing written
    again, counts, _ = generate(tiny, tmp_path / "off", VEGAFUSE_CACHE="0")
    assert counts["compiles"] == cold["compiles"] and again == ids
    generate(tiny, tmp_path / "on")
    # a switch the renderer might read: rendered again (the same text), compiled never
    _, counts, _ = generate(tiny, tmp_path / "on", VEGAFUSE_SOME_NEW_SWITCH="1")
    assert counts["renders"] >= 1 and counts["compiles"] == 0
    _, counts, _ = generate(tiny, tmp_path / "on", VEGAFUSE_RENDER_CACHE="0")
    assert counts["renders"] >= 1 and counts["compiles"] == 0


def test_statistics_line_gives_load_compile_prefill_and_decode_times(tiny, tmp_path):
    _, _, lines = generate(tiny, tmp_path)
    times = [x for x in lines if x.startswith("[load ")]
    assert len(times) == 1, lines
    m = re.fullmatch(r"\[load (\S+) s, compile (\S+) s \((\d+) objects? compiled, (\d+) from the cache\), "
                     r"prefill (\S+) s, decode (\S+) s\]", times[0])
    assert m, times[0]
    assert all(float(m.group(i)) >= 0 for i in (1, 2, 5, 6)) and float(m.group(2)) > 0


ABSENT = [b for b in ("cuda", "hip") if why_not(b)]


@pytest.mark.parametrize("backend", ABSENT)
def test_a_gpu_backend_that_is_not_there_fails_at_once_before_loading(backend, tmp_path):
    """One ``error:`` line, exit 2, within 0.5 s, and neither the compiler nor the model loaded (a
    model path that does not exist is not even looked at).  The time is the process's CPU time,
    which is its wall time on an idle machine (the shared test machine's wall clock is not)."""
    probe = ("import runpy, sys\nsys.argv = ['engine.generate', '--backend', sys.argv[1], '--model', sys.argv[2], 'hi']\n"
             "try:\n    runpy.run_module('engine.generate', run_name='__main__')\nexcept SystemExit:\n    pass\n"
             "print(sorted(m for m in ('dsl', 'llvmlite', 'engine.weights', 'engine.model') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", probe, backend, str(tmp_path / "missing.gguf")], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "[]", r.stdout
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run([sys.executable, "-m", "engine.generate", "--backend", backend, "--model",
                        str(tmp_path / "missing.gguf"), "hi"], cwd=REPO, capture_output=True, text=True, timeout=60)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: the {backend} backend cannot run here: ") and "Traceback" not in r.stderr
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    assert 0 < cpu <= 0.5, f"{cpu:.2f} s"


PROGRESS = r"""
import time
from engine.progress import progress
for _ in progress(range(4), "building kernels", unit="kernel", delay=0):
    time.sleep(0.05)
print("done")
"""


def test_progress_is_drawn_on_a_terminal_only():
    piped = subprocess.run([sys.executable, "-c", PROGRESS], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert piped.returncode == 0 and piped.stdout == "done\n" and piped.stderr == ""
    master, slave = pty.openpty()
    import fcntl
    import termios
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    p = subprocess.Popen([sys.executable, "-c", PROGRESS], cwd=REPO, stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    out, _ = p.communicate(timeout=60)
    chunks = []
    while True:
        try:
            data = os.read(master, 1 << 16)
        except OSError:                            # the child closed its end
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    shown = b"".join(chunks).decode(errors="replace")
    assert p.returncode == 0 and out == b"done\n"
    assert "building kernels" in shown and "4/4" in shown, shown


def test_run_script_once_set_up_costs_nothing(tmp_path):
    """``./run``: with the set-up recorded (its stamp newer than pyproject.toml, for this Python) it
    installs nothing and runs the command straight away."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"                 # this Python, except that pip may not run
    python.write_text(f'#!/bin/sh\nif [ "$2" = pip ]; then echo "pip ran" >&2; exit 3; fi\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    (venv / ".vegafuse-setup").write_text(f"{venv}/bin/python\n")
    env = dict(os.environ, VENV=str(venv))
    t0 = time.perf_counter()
    r = subprocess.run([str(REPO / "run"), "--help"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "--backend" in r.stdout and "installing" not in r.stderr, r.stderr
    assert "pip ran" not in r.stderr
    assert time.perf_counter() - t0 < 5
    r = subprocess.run([str(REPO / "run"), "test", "--version"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "pytest" in (r.stdout + r.stderr) and "installing" not in r.stderr
