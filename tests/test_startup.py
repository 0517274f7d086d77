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



@pytest.mark.parametrize("backend", ABSENT)
@pytest.mark.parametrize("command", [["engine.chat"], ["engine.serve", "--port", "0"], ["engine.bench", "--tokens", "2"]])
def test_every_command_checks_the_gpu_backend_before_loading(command, backend, tmp_path):
    """The chat, the server and the benchmark name the missing GPU as engine.generate does (one line,
    exit 2), not the first error a load on it would meet."""
    if command[0] == "engine.bench" and backend == "hip":
        pytest.skip("engine.bench measures the cpu and cuda backends only")
    r = subprocess.run([sys.executable, "-m", *command, "--backend", backend, "--model", str(tmp_path / "missing.gguf")],
                       cwd=REPO, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: the {backend} backend cannot run here: "), r.stderr

PROGRESS = r"""
import time
from engine.progress import progress
for _ in progress(range(4), "building kernels", unit="kernel", delay=0):
    time.sleep(0.05)
print("done")
"""


def on_a_terminal(script: str, stdout_too: bool):
    """Run ``script`` with its stderr (and, ``stdout_too``, its stdout) on a pseudo-terminal 100 columns
    wide: (exit code, its stdout when piped, what the terminal showed)."""
    import fcntl
    import termios
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    p = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=slave if stdout_too else subprocess.PIPE,
                         stderr=slave)
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
    return p.returncode, out, b"".join(chunks).decode(errors="replace")


def test_progress_is_drawn_on_a_terminal_only():
    piped = subprocess.run([sys.executable, "-c", PROGRESS], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert piped.returncode == 0 and piped.stdout == "done\n" and piped.stderr == ""
    rc, out, shown = on_a_terminal(PROGRESS, stdout_too=False)
    assert rc == 0 and out == b"done\n"
    assert "building kernels" in shown and "4/4" in shown, shown


STREAMING = r"""
import time
from engine.progress import progress, streaming
with streaming():
    print(" Paris", end="", flush=True)           # the first token, then the decode step compiles
    for _ in progress(range(4), "building kernels", unit="kernel", delay=0):
        time.sleep(0.05)
    print(".", flush=True)
"""


def test_no_bar_draws_over_text_streaming_to_the_same_terminal():
    """``engine.generate`` shows the first token before the decode step compiles: with stdout and
    stderr on one terminal, a bar would start on the text's line and blank it when it closes."""
    rc, _, shown = on_a_terminal(STREAMING, stdout_too=True)
    assert rc == 0 and shown.replace("\r\n", "\n") == " Paris.\n", repr(shown)


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


# ----------------------------------------------------------------------------- the program cache
HELPER = """
from stdlib import nn

def norm_proj(x, g, w):
    return nn.silu(nn.linear(nn.rms_norm(x, g, {eps}), w))
"""

MODEL = """
import dsl
from {helper} import norm_proj

def layer(x, g, w):
    return norm_proj(x, g, w) * {scale}
"""


def _user_model(tmp_path, name, eps="1e-5", scale="2.0"):
    """A jitted function in a module of its own, calling a helper in another module (fresh imports)."""
    import importlib
    (tmp_path / f"{name}_helper.py").write_text(HELPER.format(eps=eps))
    (tmp_path / f"{name}.py").write_text(MODEL.format(helper=f"{name}_helper", scale=scale))
    if str(tmp_path) not in sys.path:
        sys.path.insert(0, str(tmp_path))
    for m in (f"{name}_helper", name):
        sys.modules.pop(m, None)
    importlib.invalidate_caches()
    return importlib.import_module(name).layer


def _inputs(rng, k=64, n=48, t=1):
    return (rng.standard_normal((t, k)).astype("f4"), rng.standard_normal(k).astype("f4"),
            rng.standard_normal((n, k)).astype("f2"))


def _check(fn, args, got):
    want = dsl.jit(fn).lower(*args).program.run(*args, compute_dtype="f64")[0]
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-3, atol=2e-3)


def test_program_cache_loads_a_program_without_tracing_and_misses_on_any_change(tmp_path, monkeypatch):
    """A persistent jit loads its program from disk in a new jit object (as a new process would):
    no trace, the same values as float64 numpy; another shape, another fusion switch, an edited
    helper file or an edited function file each miss, and compute their own values."""
    from engine import programcache
    monkeypatch.setenv("VEGAFUSE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("VEGAFUSE_PROGRAM_CACHE", raising=False)
    rng = np.random.default_rng()
    fn = _user_model(tmp_path, "pc_model")
    counts = programcache.COUNTS

    def run(fn, args, **env):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        before = dict(counts)
        y = dsl.jit(fn, persistent=True)(*args)
        for k in env:
            monkeypatch.delenv(k)
        _check(fn, args, y)
        return "hit" if counts["hits"] > before["hits"] else "miss"

    args = _inputs(rng)
    assert run(fn, args) == "miss"
    assert run(fn, _inputs(rng)) == "hit"                                  # fresh values, no trace
    assert run(fn, _inputs(rng, t=4)) == "miss"                            # another shape
    assert run(fn, args, VEGAFUSE_FUSION_OFF="epilogue") == "miss"         # another fusion switch
    assert run(fn, args, VEGAFUSE_CPU_ROWS="4") == "miss"                  # a switch the renderer reads
    assert run(fn, args) == "hit"
    fn = _user_model(tmp_path, "pc_model", eps="1e-2")                     # the helper's file edited
    assert run(fn, args) == "miss"
    assert run(fn, _inputs(rng)) == "hit"
    fn = _user_model(tmp_path, "pc_model", eps="1e-2", scale="3.0")        # the function's file edited
    assert run(fn, args) == "miss"


def test_program_cache_keys_plain_closures_and_leaves_out_the_rest(tmp_path, monkeypatch):
    """A closure's plain values are part of the key (another value misses); a closure over a
    function is compiled every time (functions have no key), its result following the function,
    and so is any program while a compile pass is monkeypatched; VEGAFUSE_PROGRAM_CACHE=0 stores
    nothing."""
    from engine import programcache
    from stdlib import nn
    monkeypatch.setenv("VEGAFUSE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("VEGAFUSE_PROGRAM_CACHE", raising=False)
    rng = np.random.default_rng()
    x = rng.standard_normal((1, 64)).astype("f4")

    def scaled(scale):
        def f(x):
            return x * scale
        return f
    for scale, want in ((2.0, "misses"), (3.0, "misses"), (2.0, "hits")):
        before = programcache.COUNTS[want]
        np.testing.assert_allclose(dsl.jit(scaled(scale), persistent=True)(x), x * scale, rtol=1e-6)
        assert programcache.COUNTS[want] == before + 1, (scale, want)

    def activated(act):
        def f(x):
            return act(x)
        return f
    for act, ref in ((nn.silu, x / (1 + np.exp(-x))), (dsl.tanh, np.tanh(x))):
        before = dict(programcache.COUNTS)
        np.testing.assert_allclose(dsl.jit(activated(act), persistent=True)(x), ref, rtol=1e-5, atol=1e-6)
        assert programcache.COUNTS == before
    from engine import pipeline                  # a pass replaced at run time: uncached while it is
    lower = pipeline.lower_program
    monkeypatch.setattr(pipeline, "lower_program", lambda *a, **k: lower(*a, **k))
    before = dict(programcache.COUNTS)
    np.testing.assert_allclose(dsl.jit(scaled(2.0), persistent=True)(x), x * 2.0, rtol=1e-6)
    assert programcache.COUNTS == before
    monkeypatch.setattr(pipeline, "lower_program", lower)
    monkeypatch.setenv("VEGAFUSE_PROGRAM_CACHE", "0")
    fn = _user_model(tmp_path, "pc_off")
    args = _inputs(rng)
    before = dict(programcache.COUNTS)
    for _ in range(2):
        _check(fn, args, dsl.jit(fn, persistent=True)(*args))
    assert programcache.COUNTS == before


def test_a_warm_engine_process_traces_nothing(tiny, tmp_path):
    """The engine's two programs (prefill, decode) come from the program cache in a warm process,
    with the same ids; the decode step compiles after the prefill either way."""
    code = GENERATE.replace("print(json.dumps(build.COUNTS)", "from engine import programcache\n"
                            "print(json.dumps({**build.COUNTS, **programcache.COUNTS})")
    out = []
    for _ in range(2):
        r = child(code, "--model", tiny, "--temperature", "0", "--max-tokens", "4", "--json", "ab c", cache=tmp_path)
        assert r.returncode == 0, r.stderr
        out.append((json.loads(r.stdout)["ids"], json.loads(r.stderr.strip().splitlines()[-1])))
    (ids, cold), (warm_ids, warm) = out
    assert cold["misses"] == 2 and cold["hits"] == 0 and cold["compiles"] >= 2
    assert warm["hits"] == 2 and warm["misses"] == 0 and warm["compiles"] == warm["renders"] == 0
    assert warm_ids == ids and len(ids) >= 1


@pytest.mark.parametrize("name,value,message", [
    ("VEGAFUSE_CACHE", "false", "VEGAFUSE_CACHE='false': set it to 1 or 0, or unset it (default 1)"),
    ("VEGAFUSE_CPU_VNNI", "off", "VEGAFUSE_CPU_VNNI='off': set it to one of 512, 256, 0, or unset it (default 512)"),
    ("VEGAFUSE_CPU_COLUMNS", "many", "VEGAFUSE_CPU_COLUMNS='many' is not a whole number; set it to one "
                                     "(e.g. VEGAFUSE_CPU_COLUMNS=4096) or unset it"),
    ("VEGAFUSE_SPIN_US", "inf", "VEGAFUSE_SPIN_US='inf': set it to microseconds from 0 to 1000000, or unset it "
                                "(default 2000)"),
    ("VEGAFUSE_PROGRAM_CACHE", "true", "VEGAFUSE_PROGRAM_CACHE='true': set it to 1 or 0, or unset it (default 1)")])
def test_a_switch_with_a_value_it_does_not_take_is_one_line_naming_it(name, value, message):
    """An on/off switch, one of a few words, a whole number (``codegen.env``): each once took any other
    value as its default, silently (an A/B of ``VEGAFUSE_CPU_VNNI=off`` measured the default twice)."""
    r = subprocess.run([sys.executable, "-m", "engine.generate", "-n", "2", "Hi"], cwd=REPO, capture_output=True,
                       text=True, timeout=300, env={**os.environ, name: value})
    assert r.returncode == 2 and r.stderr == f"error: {message}\n", r.stderr


@pytest.mark.parametrize("name,value,message", [
    ("VEGAFUSE_X", "0", "VEGAFUSE_X='0': set it to at least 1, or unset it (default 5)"),
    ("VEGAFUSE_X", "1_0", "VEGAFUSE_X='1_0' is not a whole number; set it to one (e.g. VEGAFUSE_X=5) or unset it"),
    ("VEGAFUSE_X", "١", "VEGAFUSE_X='١' is not a whole number; set it to one (e.g. VEGAFUSE_X=5) or unset it")])
def test_a_whole_number_switch_takes_ascii_digits_within_its_bounds(name, value, message, monkeypatch):
    """``codegen.env.env_int``: a value below the least is said so (it once read "not a whole number"),
    and Python's other spellings of a number (1_0, other scripts' digits) are not whole numbers here."""
    from codegen.env import env_int
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as e:
        env_int(name, 5, 1)
    assert str(e.value) == message
    monkeypatch.setenv(name, " -3 ")
    assert env_int(name, 5) == -3
