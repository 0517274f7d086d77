"""Adversarial cases for the matmul family and the paired_epilogue rule (issue 10's review):
each against the float64 interpreter on fresh random inputs, and compiled for gfx906 where a
GPU kernel is at stake."""
import numpy as np
import pytest

import dsl
from codegen import loopir as L
from stdlib import nn

rng = np.random.default_rng()


def randn(*shape, dtype=np.float32, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def run(f, *args, donate=(), tol=2e-4):
    """``f`` on the CPU against the float64 interpreter; returns the compiled program."""
    jf = dsl.jit(f, backend="cpu", donate_argnums=donate)
    want = jf.lower(*args).program.run(*dsl.tree_flatten(list(args))[0], compute_dtype="f64")
    got = dsl.tree_flatten(jf(*[a.copy() if isinstance(a, np.ndarray) else a for a in args]))[0]
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=tol, atol=tol * max(1.0, np.abs(w).max()))
    return jf.compile(*args)


def on_gpu(f, *args, donate=(), tol=1e-2, monkeypatch=None):
    """``f`` on an NVIDIA GPU at wave 32 and 64 (gfx906's kernel text) against the float64
    interpreter; skipped without one."""
    try:
        from engine.executable import get_device
        get_device("cuda", wave=32)
    except Exception as e:                                   # noqa: BLE001  (no driver, no GPU)
        pytest.skip(f"no CUDA device: {e}")
    for wave in (32, 64):
        monkeypatch.setenv("VEGAFUSE_CUDA_WAVE", str(wave))
        jf = dsl.jit(f, backend="cuda", donate_argnums=donate)
        want = jf.lower(*args).program.run(*dsl.tree_flatten(list(args))[0], compute_dtype="f64")
        got = dsl.tree_flatten(jf(*[a.copy() if isinstance(a, np.ndarray) else a for a in args]))[0]
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=tol, atol=tol * max(1.0, np.abs(w).max()),
                                       err_msg=f"wave {wave}")


def gfx906(kernels):
    """Every kernel rendered and compiled for gfx906 (hiprtc; skipped without it)."""
    from engine.devices.rocm import HipUnavailable, find_hiprtc
    try:
        find_hiprtc()
    except HipUnavailable as e:
        pytest.skip(f"gfx906 compile skipped: {e}")
    from tests.fuzz import _compile_gfx906
    _compile_gfx906(kernels)


@pytest.mark.parametrize("T", [4, 130])
def test_matmul_with_one_column_of_k_compiles_for_gfx906(T):
    """K = 1: the simplifier drops the activation fill's k loop, and the GPU's row groups must
    still rename the tile's row in the fill (it was left undeclared: 'use of undeclared identifier')."""
    c = run(lambda x, w: nn.linear(x, w) * 2.0, randn(T, 1), randn(5, 1))
    gfx906(c.plan.kernels)


def gptj_rope(y, pos):
    """GPT-J's interleaved rotation of y [H, T, hd]: pairs (2i, 2i + 1) at positions pos + t."""
    H, T, hd = y.shape
    ang = (dsl.arange(T) + pos).astype("f32")[:, None] * (0.5 ** dsl.arange(hd // 2, dtype="f32"))
    pr = y.reshape(H, T, hd // 2, 2)
    a, b = pr[..., 0], pr[..., 1]
    return dsl.stack([a * dsl.cos(ang) - b * dsl.sin(ang), a * dsl.sin(ang) + b * dsl.cos(ang)], axis=-1).reshape(H, T, hd)


@pytest.mark.parametrize("T", [4, 9])
@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_interleaved_rope_over_a_quantized_matmul_into_the_cache(T, fmt):
    """An interleaved (GPT-J) rotation in the epilogue of a T-row matmul with quantized weights,
    written into a cache at a runtime position.  The pairing at distance 1 left ``q % 1`` among the
    pair's parts, the weight row was not written as an affine function of the pair, kept the tile's
    row, and the CPU micro-tile dequantized it where that row is not bound ("unknown name")."""
    H, hd, K, S = 3, 16, 64, 16
    w = dsl.QArray.quantize(randn(H * hd, K, scale=K ** -0.5), fmt)

    def f(x, w, cache, pos):
        y = nn.linear(x, w).reshape(T, H, hd).transpose(1, 0, 2)
        return dsl.dynamic_update_slice(cache, gptj_rope(y, pos), [0, pos, 0])
    c = run(f, randn(T, K), w, randn(H, S, hd), int(rng.integers(0, S - T + 1)), donate=(2,), tol=2e-3)
    (k,) = c.plan.kernels
    (col,) = [s for s in L.walk_stmts(k.body) if isinstance(s, L.Loop) and s.parallel]
    (red,) = [s for s in L.walk_stmts(col.body) if isinstance(s, L.Reduce)]
    rows = {x.name for a in red.accs for q in L.walk_exprs(a.value) if isinstance(q, L.QLoad)
            for x in L.walk_exprs(q.index) if isinstance(x, L.Sym)}
    assert rows == {col.var, red.var}, rows                    # a weight row is a function of the pair alone
    gfx906(c.plan.kernels)


@pytest.mark.parametrize("T", [1, 4])
def test_contraction_over_a_long_k_compiles_for_gfx906(T):
    """An activation row past gfx906's 64 KiB of LDS (K 40000 as f16; Llama-3.1-405B's down projection
    has K 53248) was staged whole in LDS and hiprtc failed ('local memory exceeds limit'); it is now a
    slice a workgroup in device memory (``codegen.mapping._activation_beyond_lds``), and the kernel's
    LDS is its reductions' alone."""
    from codegen.hip import render_hip
    K = 40000
    c = run(lambda x, g, w: nn.linear(nn.rms_norm(x, g, 1e-5), w), randn(T, K), randn(K), randn(3, K, dtype=np.float16),
            tol=1e-3)
    (k,) = c.plan.kernels
    h = render_hip(k, "gfx906")
    assert "in device memory, a slice a workgroup" in h.kernel.launch.how and h.kernel.launch.lds < 1024
    assert "act_slices + (size_t)blockIdx.x * 40000" in h.body
    gfx906(c.plan.kernels)


@pytest.mark.parametrize("T", [1, 4])
def test_contraction_over_a_long_k_runs_on_nvidia_at_both_waves(T, monkeypatch):
    """K 40000: at wave 64 the kernel is gfx906's text, its activation a slice a workgroup in device
    memory; at wave 32 it fits sm_90's dynamic LDS."""
    K = 40000
    on_gpu(lambda x, g, w: nn.linear(nn.rms_norm(x, g, 1e-5), w), randn(T, K), randn(K), randn(3, K, dtype=np.float16),
           tol=2e-3, monkeypatch=monkeypatch)


@pytest.mark.parametrize("K", [1, 8])
def test_matmul_whose_activation_fill_names_a_local_compiles_for_gfx906(K):
    """A prologue that reads its input twice (``x * x``): the simplifier names the load as a local
    in the fill's k loop, which the GPU's row groups took for a lone store ("too many values to
    unpack" while mapping)."""
    c = run(lambda x, w: nn.linear(x * x, w), randn(5, K), randn(8, K, dtype=np.float16), tol=1e-3)
    gfx906(c.plan.kernels)


@pytest.mark.parametrize("argv,message", [
    (["--position", "99999"], "--position is measured with --backend cuda"),
    (["--reference-tokens", "0"], "at least 1 token"),
    (["--tokens", "-2"], "at least 1 token"),
])
def test_bench_options_it_would_ignore_or_misreport_are_one_clear_error(argv, message, capsys):
    """On the CPU ``--position`` was ignored without a word, and ``--reference-tokens 0`` printed a
    negative tokens/s."""
    from engine import bench
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_the_fixed_matmul_kernels_on_the_gpu(monkeypatch):
    """The three GPU matmul texts fixed above (K = 1, a fill with a named local, an interleaved RoPE
    over quantized weights into a cache) run on an NVIDIA GPU at wave 32 and 64."""
    on_gpu(lambda x, w: nn.linear(x, w) * 2.0, randn(130, 1), randn(5, 1), monkeypatch=monkeypatch)
    on_gpu(lambda x, w: nn.linear(x * x, w), randn(5, 8), randn(8, 8, dtype=np.float16), monkeypatch=monkeypatch)
    T, H, hd, K, S = 9, 3, 16, 64, 16
    w = dsl.QArray.quantize(randn(H * hd, K, scale=K ** -0.5), "q4_0")

    def f(x, w, cache, pos):
        y = nn.linear(x, w).reshape(T, H, hd).transpose(1, 0, 2)
        return dsl.dynamic_update_slice(cache, gptj_rope(y, pos), [0, pos, 0])
    on_gpu(f, randn(T, K), w, randn(H, S, hd), 5, donate=(2,), monkeypatch=monkeypatch)


def attention_kernel(hq, hkv, t, s, d, kv):
    from tests.test_attention_gpu import attention_kernel as kernel
    return kernel(hq, hkv, t, s, d, kv)


@pytest.mark.parametrize("target", ["gfx906", "sm_90"])
def test_prefill_attention_with_wide_heads_takes_fewer_query_rows(target, tmp_path):
    """Head dim 256 (Gemma-2) with an f32 cache: 8 query positions x 2 heads did not fit gfx906's
    attention LDS even at 8 keys, and the kernel was refused ("use fewer query heads per KV head")
    where a tile of fewer query positions fits.  The kernel text (CPU emulation of the GPU threads)
    against the float64 interpreter, and its gfx906 build."""
    from tests.test_attention_gpu import GXX, emulate
    hq, hkv, t, s, d = 4, 2, 20, 60, 256
    k = attention_kernel(hq, hkv, t, s, d, "f4")
    if target == "gfx906":
        gfx906([k])
    if not GXX:
        pytest.skip("no g++ for the CPU emulation of the GPU kernel text")
    f = dsl.jit(lambda q, kc, vc, pos: dsl.attention(q, kc, vc, pos, d ** -0.5))
    for pos in (0, 17, s - t):
        q, kc, vc = randn(hq, t, d), randn(hkv, s, d), randn(hkv, s, d)
        out = np.full((hq, t, d), np.nan, np.float32)
        named = {"q": q, "kc": kc, "vc": vc, "pos": np.array([pos], np.int32)}
        emulate(k, target, [named.get(p.name, out) for p in k.params], str(tmp_path))
        want = f.lower(q, kc, vc, pos).program.run(q, kc, vc, pos, compute_dtype="f64")[0]
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4, err_msg=f"pos {pos}")


@pytest.mark.parametrize("hq,hkv,d,kv", [(64, 8, 128, "f2"), (32, 2, 128, "f2"), (12, 1, 128, "f2"), (16, 1, 256, "f2"),
                                         (16, 1, 256, "f4"), (16, 1, 64, "f4"), (12, 2, 128, "f2"), (28, 4, 128, "f2")])
def test_decode_attention_with_large_groups_has_no_scratch_on_gfx906(hq, hkv, d, kv):
    """gfx906 decode attention with 8 or more query heads per KV head (Llama-3-70B / Qwen2.5-72B: 64/8
    heads of 128) spilled 60-80 bytes to scratch, and Qwen2.5's groups of 6 and 7 took 216-241
    registers (one wave per SIMD): the workgroup's heads and keys in flight now fit a register budget.
    No scratch and at least two waves per SIMD at every layout up to 16 heads per KV head of 256."""
    from engine.devices.rocm import HipUnavailable, find_hiprtc
    try:
        find_hiprtc()
    except HipUnavailable as e:
        pytest.skip(f"gfx906 compile skipped: {e}")
    from codegen.inspect import Inspected
    from codegen.targets import get_target
    it = Inspected(attention_kernel(hq, hkv, 1, 1024, d, kv), get_target("gfx906"))
    assert it.res["scratch_bytes"] == 0 and it.res["waves_per_simd"] >= 2, it.res


def test_prefill_attention_with_a_large_group_of_wide_heads_compiles_for_gfx906(tmp_path):
    """16 query heads per KV head of 256 with an f32 cache did not fit gfx906's attention LDS even at
    one query position: the register-blocked prefill takes the KV group's heads over several
    workgroups.  Its gfx906 build (no scratch), and its text against the float64 interpreter."""
    from tests.test_attention_gpu import GXX, emulate
    k = attention_kernel(16, 1, 7, 128, 256, "f4")
    gfx906([k])
    if not GXX:
        pytest.skip("no g++ for the CPU emulation of the GPU kernel text")
    f = dsl.jit(lambda q, kc, vc, pos: dsl.attention(q, kc, vc, pos, 256 ** -0.5))
    for pos in (0, 121):
        q, kc, vc = randn(16, 7, 256), randn(1, 128, 256), randn(1, 128, 256)
        out = np.full((16, 7, 256), np.nan, np.float32)
        named = {"q": q, "kc": kc, "vc": vc, "pos": np.array([pos], np.int32)}
        emulate(k, "gfx906", [named.get(p.name, out) for p in k.params], str(tmp_path))
        want = f.lower(q, kc, vc, pos).program.run(q, kc, vc, pos, compute_dtype="f64")[0]
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4, err_msg=f"pos {pos}")
