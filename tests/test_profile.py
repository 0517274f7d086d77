"""The decode profiler (``engine/profile.py``): its arithmetic on a synthetic kernel list with
known times, bytes and FLOPs (no device); SmolLM2 profiled on the CPU (the kernel count, the bytes
per token against the weights and KV reads, the times adding up, profile.json and roofline.png);
the ``--profile`` options of engine.generate and engine.bench.  The same SmolLM2 check runs on
a GPU in ``tests/test_cuda.py`` (``test_profile_smollm2_on_the_gpu``)."""
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from engine.profile import _int_value, analyze, format_table, regime, write

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
rng = np.random.default_rng()
PNG = b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------ arithmetic
@pytest.mark.parametrize("bw,flops,gaps,want", [
    (78, 4, 0, "bandwidth-bound"),          # the regime table's case A: the chatbot at batch 1
    (30, 71, 0, "compute-bound"),           # case D: batch 256
    (14, 3, 38, "launch-bound"),            # case E: 450 kernels with gaps of 38% of the step
    (14, 3, 5, "latency-bound"),            # nothing saturated, and not for want of launches
    (60, 55, 0, "balanced"),                # near the ridge
    (None, None, 0, "latency-bound"),       # unmeasured counts as low
])
def test_regime_reads_the_two_percentages_as_the_case_studies_table(bw, flops, gaps, want):
    assert regime(bw, flops, gaps) == want


def synthetic(steps=5):
    """Two layers of two kernels and a head, with times that vary by step: (launches, kernel_us,
    token_us, gap_us, plan_us, ceilings)."""
    names = ["layers_0_gemv", "layers_0_attention", "layers_1_gemv", "layers_1_attention", "head"]
    nbytes = rng.uniform(1e5, 1e6, len(names))
    flops = rng.uniform(1e5, 1e7, len(names))
    launches = [{"name": n, "family": "contract", "ops": ["dot", "add"] if "gemv" in n else ["attention"],
                 "bytes": float(b), "flops": float(f)} for n, b, f in zip(names, nbytes, flops)]
    kernel_us = rng.uniform(5, 50, (steps, len(names)))
    gap_us = rng.uniform(1, 20, steps)
    token_us = kernel_us.sum(1) + gap_us
    return launches, kernel_us, token_us, gap_us, rng.uniform(50, 150, steps), \
        {"bandwidth_gbs": float(rng.uniform(50, 500)), "gflops": float(rng.uniform(100, 1000))}


def test_analyze_groups_layers_and_computes_rates_shares_and_the_batch1_ceiling():
    launches, kernel_us, token_us, gap_us, plan_us, ceil = synthetic()
    r = analyze(launches, kernel_us, token_us, ceil, gap_us, plan_us)
    rows = {row["name"]: row for row in r["kernels"]}
    assert set(rows) == {"layers_#_gemv", "layers_#_attention", "head"}
    token = token_us.mean()
    for name, idx in (("layers_#_gemv", [0, 2]), ("layers_#_attention", [1, 3]), ("head", [4])):
        row, us = rows[name], kernel_us[:, idx].mean(0).sum()
        nbytes = sum(launches[i]["bytes"] for i in idx)
        flops = sum(launches[i]["flops"] for i in idx)
        assert row["kernels"] == [launches[i]["name"] for i in idx] and row["calls_per_token"] == len(idx)
        assert row["us_per_token"] == pytest.approx(us) and row["mean_us"] == pytest.approx(us / len(idx))
        assert row["bytes"] == pytest.approx(nbytes / len(idx)) and row["flops"] == pytest.approx(flops / len(idx))
        assert row["gbs"] == pytest.approx(nbytes / (us * 1e-6) / 1e9)
        assert row["gflops"] == pytest.approx(flops / (us * 1e-6) / 1e9)
        assert row["pct_bandwidth"] == pytest.approx(100 * row["gbs"] / ceil["bandwidth_gbs"])
        assert row["pct_flops"] == pytest.approx(100 * row["gflops"] / ceil["gflops"])
        assert row["share"] == pytest.approx(100 * us / token)
        assert row["intensity"] == pytest.approx(flops / nbytes)
        assert row["regime"] == regime(row["pct_bandwidth"], row["pct_flops"])
    assert [row["us_per_token"] for row in r["kernels"]] == sorted((x["us_per_token"] for x in r["kernels"]),
                                                                  reverse=True)
    t, nbytes, flops = r["token"], sum(x["bytes"] for x in launches), sum(x["flops"] for x in launches)
    assert t["kernels"] == 5 and t["token_us"] == pytest.approx(token)
    assert t["kernel_us"] + t["gap_us"] == pytest.approx(token)          # the synthetic steps add up
    assert t["gap_share"] == pytest.approx(100 * gap_us.mean() / token)
    assert t["bytes"] == pytest.approx(nbytes) and t["flops"] == pytest.approx(flops)
    assert t["gbs"] == pytest.approx(nbytes / token / 1e3) and t["gflops"] == pytest.approx(flops / token / 1e3)
    assert t["plan_us"] == pytest.approx(plan_us.mean()) and t["tokens_per_s"] == pytest.approx(1e6 / plan_us.mean())
    assert t["plan_gap_us"] == pytest.approx(plan_us.mean() - kernel_us.mean(0).sum())
    assert t["plan_pct_bandwidth"] == pytest.approx(100 * nbytes / plan_us.mean() / 1e3 / ceil["bandwidth_gbs"])
    assert t["plan_pct_flops"] == pytest.approx(100 * flops / plan_us.mean() / 1e3 / ceil["gflops"])
    assert t["plan_regime"] == regime(t["plan_pct_bandwidth"], t["plan_pct_flops"],
                                      max(0.0, 100 * t["plan_gap_us"] / plan_us.mean()))
    assert t["ceiling_tokens_per_s"] == pytest.approx(ceil["bandwidth_gbs"] * 1e9 / nbytes)
    assert t["pct_of_ceiling"] == pytest.approx(100 * t["tokens_per_s"] / t["ceiling_tokens_per_s"])
    assert [x["mean_us"] for x in r["launches"]] == pytest.approx(list(kernel_us.mean(0)))
    text = format_table(r)
    assert all(name in text for name in rows) and "batch-1 ceiling" in text


def test_gaps_default_to_the_step_minus_its_kernels_and_launch_bound_steps_say_so():
    """Kernels that keep 1% of the bandwidth and FLOP ceilings busy, in steps whose time is mostly
    gaps (case E of the regime table): each kernel is latency-bound, the token launch-bound."""
    launches = [{"name": f"k{i}", "family": "elementwise", "ops": ["add"], "bytes": 1e3, "flops": 1e2}
                for i in range(4)]
    kernel_us = np.full((3, 4), 10.0)                       # 1e3 bytes in 10 µs: 0.1 GB/s
    r = analyze(launches, kernel_us, np.full(3, 100.0), {"bandwidth_gbs": 10.0, "gflops": 1.0})
    assert r["token"]["gap_us"] == pytest.approx(60.0) and r["token"]["gap_share"] == pytest.approx(60.0)
    assert r["token"]["regime"] == "launch-bound" and r["token"]["plan_us"] is None
    assert r["token"]["tokens_per_s"] == pytest.approx(1e4)          # no plan: the timed steps' rate
    assert {row["regime"] for row in r["kernels"]} == {"latency-bound"}
    assert r["kernels"][0]["pct_bandwidth"] == pytest.approx(1.0)


def test_a_step_launch_bound_one_by_one_and_bandwidth_bound_as_a_graph():
    """Kernels at 80% of the bandwidth whose step, launched one by one, spends 5 µs per kernel
    between them, while the plan's graph adds 5% to the kernels: launch-bound as launched, and
    bandwidth-bound as the plan runs the step (the batch-1 ceiling's percentage follows the plan)."""
    n, us = 150, rng.uniform(1.0, 3.0)
    launches = [{"name": f"layers_{i}_gemv", "family": "contract", "ops": ["dot"], "bytes": 800.0 * us * 4,
                 "flops": 2.0 * us * 4} for i in range(n)]                  # 3.2 GB/s of a 4 GB/s ceiling
    kernel_us = np.full((4, n), us)
    r = analyze(launches, kernel_us, np.full(4, n * (us + 5.0)), {"bandwidth_gbs": 4.0, "gflops": 100.0},
                plan_us=np.full(4, 1.05 * n * us))
    t, (row,) = r["token"], r["kernels"]
    assert row["regime"] == "bandwidth-bound" and row["pct_bandwidth"] == pytest.approx(80.0)
    assert t["regime"] == "launch-bound" and t["gap_share"] == pytest.approx(100 * 5 / (us + 5))
    assert t["plan_regime"] == "bandwidth-bound" and t["plan_pct_bandwidth"] == pytest.approx(80 / 1.05)
    assert t["pct_of_ceiling"] == pytest.approx(80 / 1.05)


def test_analyze_rejects_times_of_the_wrong_shape():
    launches, kernel_us, token_us, *_ = synthetic()
    with pytest.raises(ValueError, match=r"kernel_us must be \[steps, kernels\] = \[5, 5\]"):
        analyze(launches, kernel_us[:, :3], token_us, {"bandwidth_gbs": 1, "gflops": 1})


def test_int_value_evaluates_an_attention_position():
    from codegen import loopir as L
    pos = L.Bin("max", L.Const(0, "i32"), L.Bin("min", L.Sym("pos", "i32"), L.Const(255, "i32")))
    assert _int_value(pos, {"pos": 17}) == 17 and _int_value(pos, {"pos": 999}) == 255
    assert _int_value(pos, {}) is None
    assert _int_value(L.Load("x", L.Const(0, "i32"), "i32"), {"pos": 1}) is None


def test_without_matplotlib_the_json_is_written_and_one_line_says_why(tmp_path, monkeypatch):
    launches, kernel_us, token_us, gap_us, plan_us, ceil = synthetic()
    report = analyze(launches, kernel_us, token_us, ceil, gap_us, plan_us)
    out = io.StringIO()
    write(report, str(tmp_path / "with"), out)
    assert (tmp_path / "with" / "roofline.png").read_bytes()[:8] == PNG
    monkeypatch.setitem(sys.modules, "matplotlib", None)          # import matplotlib raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    out = io.StringIO()
    write(report, str(tmp_path / "without"), out)
    lines = out.getvalue().strip().splitlines()
    assert len(lines) == 1 and "matplotlib is not installed" in lines[0] and "vegafuse[profile]" in lines[0]
    assert json.loads((tmp_path / "without" / "profile.json").read_text())["token"]["kernels"] == 5
    assert not (tmp_path / "without" / "roofline.png").exists()


# ------------------------------------------------------------------------------ SmolLM2
def check_profile(backend, out_dir, steps=6, context=64):
    """SmolLM2 profiled on ``backend``: the kernel count per token is the fusion report's, the bytes
    per token are the weights' plus the KV reads within 5% (on the CPU each attention's exactly its
    keys and values up to the position, its query and its output), the kernel times plus the gaps
    are the token time within 10%, profile.json lists every kernel and roofline.png is a PNG."""
    from dsl import tree_flatten
    from engine.model import KV_DTYPES, open_model
    from engine.profile import profile_model
    from engine.weights import default_model_path
    m, tok, _ = open_model(default_model_path(), backend=backend, context=context)
    first = int(np.argmax(np.asarray(m.prefill(tok.encode("The capital of France is")))))
    err = io.StringIO()
    report = profile_model(m, first, steps=steps, out_dir=str(out_dir), file=err)
    ex = m.greedy_step.compile(m.params, np.zeros(1, np.int32), 0, 0, m.cache)
    t, cfg = report["token"], m.cfg
    assert t["kernels"] == int(ex.fusion_report().split()[0]) == len(ex.plan.kernels)
    assert sum(r["calls_per_token"] for r in report["kernels"]) == t["kernels"]
    p0, p1 = report["positions"]
    assert p1 == p0 + len(report["modes"]) * (steps - 1)      # the modes' steps interleave
    keys = (p0 + p1) / 2 + 1                                 # the mean keys a timed step reads
    kv_layer = 2 * cfg.n_kv_heads * cfg.head_dim * np.dtype(KV_DTYPES[m.kv_dtype]).itemsize * keys
    weights = sum(int(a.nbytes) for a in tree_flatten(m.params)[0])
    want = weights + cfg.n_layers * kv_layer
    assert abs(t["bytes"] - want) <= 0.05 * want, (t["bytes"], weights, want)
    if backend == "cpu":
        q_out = 2 * cfg.n_heads * cfg.head_dim * 4            # q in and the output out, f32
        att = [x for x in report["launches"] if x["name"].endswith("causal_attention")]
        assert len(att) == cfg.n_layers and all(x["bytes"] == pytest.approx(kv_layer + q_out) for x in att)
    total = sum(r["us_per_token"] for r in report["kernels"]) + t["gap_us"]
    assert abs(total - t["token_us"]) <= 0.1 * t["token_us"], (total, t["token_us"])
    assert t["tokens_per_s"] > 0 and 0 < t["pct_of_ceiling"] and t["regime"]
    saved = json.loads((out_dir / "profile.json").read_text())
    names = [k.name for k in ex.plan.kernels]
    assert [x["name"] for x in saved["launches"]] == names
    assert sorted(n for r in saved["kernels"] for n in r["kernels"]) == sorted(names)
    png = (out_dir / "roofline.png").read_bytes()
    assert len(png) > 1000 and png[:8] == PNG
    text = err.getvalue()
    assert all(r["name"][:48] in text for r in report["kernels"]) and "batch-1 ceiling" in text
    return report


def test_profile_smollm2_on_the_cpu(tmp_path):
    check_profile("cpu", tmp_path)


# ------------------------------------------------------------------------------ the command lines
def run(module, *args):
    r = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    return r


def test_generate_profile_writes_its_files(tmp_path):
    r = run("engine.generate", "-n", "3", "--temperature", "0", "-c", "96", "--profile", str(tmp_path),
            "The capital of France is")
    assert "decode profile:" in r.stderr and "batch-1 ceiling" in r.stderr and r.stdout.strip()
    report = json.loads((tmp_path / "profile.json").read_text())
    assert report["backend"] == "cpu" and report["token"]["kernels"] > 100
    assert (tmp_path / "roofline.png").read_bytes()[:8] == PNG


def test_profile_options_that_cannot_work_are_one_error_line(tmp_path):
    for module, args, needle in [
            ("engine.generate", ["--backend", "reference", "--profile", str(tmp_path), "Hi"], "reference"),
            ("engine.generate", ["--profile", "Once upon a time"], "--profile took"),
            ("engine.bench", ["--profile", str(tmp_path), "--prefill", "8"], "--profile")]:
        r = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                           timeout=600, stdin=subprocess.DEVNULL)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], \
            r.stderr


def test_bench_profile_on_a_tiny_model(tmp_path):
    from tests.test_weights import tiny_hf_weights, write_tiny_gguf
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_hf_weights())
    r = run("engine.bench", "--model", tiny, "--tokens", "4", "--reference-tokens", "1", "--no-hf",
            "--prompt", "ab c", "--profile", str(tmp_path / "prof"))
    assert "| tiny f16" in r.stdout and "decode profile:" in r.stderr
    report = json.loads((tmp_path / "prof" / "profile.json").read_text())
    assert report["steps"] == 4 and report["token"]["tokens_per_s"] > 0


def test_the_gpu_modes_on_the_cpu_device_with_host_time_events(tmp_path, monkeypatch):
    """The GPU's path through the profiler (events as marks, the hold while the step is queued, the
    step as launched one by one beside the kernels) run on the CPU device given event primitives
    that read the host's clock: three modes interleaved, the gaps the launched step's time minus the
    kernels' (tests/test_cuda.py runs it on a GPU)."""
    import time
    from engine import profile
    from engine.executable import get_device
    dev, held = get_device("cpu"), []

    class Event:
        t = 0.0
    hold = profile._Hold.__call__

    def counted_hold(self):
        held.append(self.n)
        hold(self)
    monkeypatch.setattr(profile._Hold, "BYTES", 1 << 12)                # copies of 4 KiB on the CPU
    monkeypatch.setattr(profile._Hold, "__call__", counted_hold)
    for name, value in dict(_event=Event, _record=lambda ev: setattr(ev, "t", time.perf_counter()),
                            _elapsed_ms=lambda a, b: 1e3 * (b.t - a.t), copy_bandwidth=lambda: 1.0,
                            stream=None).items():
        monkeypatch.setattr(dev, name, value, raising=False)
    report = check_profile("cpu", tmp_path, steps=3)
    t = report["token"]
    assert report["modes"] == ["kernels", "launches", "plan"] and "graphs off" in report["timing"]
    assert t["gap_us"] == pytest.approx(t["token_us"] - t["kernel_us"])
    assert len(held) == profile.WARMUP + 3 and held[-1] >= 1


def test_marginal_costs_need_a_gpu_graph_and_say_so_in_one_line(tmp_path):
    """``marginal_costs`` on the CPU backend and ``engine.bench --marginal`` where it cannot work: one
    line naming the problem (tests/test_cuda.py measures it on a GPU)."""
    from engine.errors import ModelError
    from engine.model import Model
    from engine.profile import marginal_costs
    from tests.test_weights import tiny_hf_weights, write_tiny_gguf
    from engine.weights import load_model
    cfg, params, _ = load_model(write_tiny_gguf(tmp_path / "tiny.gguf", tiny_hf_weights()), "f32")
    with pytest.raises(ModelError, match="marginal costs time a GPU's graph: the cpu backend has none"):
        marginal_costs(Model(cfg, params, backend="cpu", context=32), 1, steps=2)
    import types
    gpu = types.SimpleNamespace(device=types.SimpleNamespace(_event=None), backend="cuda", pos=24, context=32)
    for steps, position in ((10, None), (4, -1), (0, 0), (33, 0)):        # past the cache, before it, no step
        with pytest.raises(ModelError, match=r"^marginal costs of .* decode steps from position .* raise --context"):
            marginal_costs(gpu, 1, steps=steps, position=position)
    for args in (["--marginal", "--prefill", "8"], ["--marginal", "--backend", "cpu"]):
        r = subprocess.run([sys.executable, "-m", "engine.bench", *args], cwd=ROOT, capture_output=True, text=True,
                           timeout=600, stdin=subprocess.DEVNULL)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and "--marginal" in lines[0], r.stderr
    for args in (["--phases", "--backend", "cpu"], ["--phases", "--backend", "cuda", "--ab", "VEGAFUSE_PERSISTENT_QUIET=0"]):
        r = subprocess.run([sys.executable, "-m", "engine.bench", *args], cwd=ROOT, capture_output=True, text=True,
                           timeout=600, stdin=subprocess.DEVNULL)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and "--phases traces the persistent decode kernel" in lines[0], r.stderr


def test_kernel_times_times_each_kernel_of_a_jitted_function():
    """``kernel_times`` on the CPU: one median per kernel of the plan, in launch order, and the
    plan's own call; examples/bench_sampler.py prints them for the device sampler."""
    import os
    import subprocess
    import sys

    import dsl
    from engine.profile import kernel_times
    x = np.random.default_rng().standard_normal(4096).astype(np.float32)
    f = dsl.jit(lambda x: dsl.exp(x - dsl.max(x)) / dsl.sum(dsl.exp(x - dsl.max(x))), backend="cpu")
    t = kernel_times(f, x, steps=5, warmup=2)
    names = [ck.kernel.name for ck in f.compile(x).kernels]
    assert [n for n, _ in t["kernels"]] == names and all(us > 0 for _, us in t["kernels"]) and t["plan_us"] > 0
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, os.path.join(root, "examples", "bench_sampler.py"), "--vocab", "3000",
                        "--steps", "3", "--top-k", "20"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "cpu: 3000 ids, top-k 20, 64 parts a search pass: 26 kernels" in r.stdout, r.stdout
    assert "add_sub_mul_idiv_le_where_sum_2" in r.stdout, r.stdout             # the draw's second pass over ids


def test_kernel_times_and_bench_sampler_name_bad_input():
    """``kernel_times`` with no timed step, and examples/bench_sampler.py with an empty vocabulary,
    no step or a backend that cannot run here: one line naming the problem, no traceback."""
    import subprocess
    import sys

    import dsl
    from engine.profile import kernel_times
    x = rng.standard_normal(300).astype(np.float32)
    with pytest.raises(ValueError, match="kernel_times needs steps >= 1 and warmup >= 0"):
        kernel_times(dsl.jit(lambda x: dsl.exp(x), backend="cpu"), x, steps=0)
    script = os.path.join(ROOT, "examples", "bench_sampler.py")
    for args, needle in ((["--vocab", "0"], "--vocab and --steps must be >= 1"),
                         (["--vocab", "300", "--steps", "0"], "--vocab and --steps must be >= 1"),
                         (["--backend", "rocm"], "invalid choice: 'rocm'")):
        r = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and "Traceback" not in r.stderr and needle in r.stderr.splitlines()[-1], r.stderr
