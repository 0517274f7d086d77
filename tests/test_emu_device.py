"""The GPU path end to end without a GPU (``tests/emu_device.py``): plans, buffers and launches of
the engine, each kernel's sm_90 text run by the CPU emulation, against the float64 interpreter and
against the CPU backend on a small Qwen2-shaped model."""
import re

import numpy as np
import pytest

import dsl
from stdlib import nn
from tests.emulation import GXX

pytestmark = pytest.mark.skipif(not GXX, reason="no g++ for the CPU emulation of the GPU kernel text")
rng = np.random.default_rng()


def test_a_quantized_mlp_and_a_long_argmax_match_the_float64_interpreter():
    from tests.emu_device import emu_backend
    from tests.test_quant_kernels import quantized
    D, F, V = 128, 256, 12000
    x, g = rng.standard_normal((1, D)).astype(np.float32), rng.uniform(0.5, 1.5, D).astype(np.float32)
    wg, wu, wd, head = (quantized(s, "q4_0", 0.05) for s in ((F, D), (F, D), (D, F), (V, D)))

    def step(x, g, wg, wu, wd, head):
        x = x + nn.linear(nn.silu(nn.linear(nn.rms_norm(x, g, 1e-5), wg)) * nn.linear(nn.rms_norm(x, g, 1e-5), wu), wd)
        logits = nn.linear(x, head).reshape(-1)
        return x, dsl.argmax(logits)
    jf = dsl.jit(step, backend=emu_backend())
    args = (x, g, wg, wu, wd, head)
    want_x, _ = jf.lower(*args).program.run(*args, compute_dtype="f64")
    got_x, got_id = jf(*args)
    np.testing.assert_allclose(np.asarray(got_x, np.float64), want_x, rtol=0, atol=2e-2 * np.abs(want_x).max())
    logits = np.asarray(dsl.jit(lambda *a: nn.linear(step(*a)[0], a[-1]).reshape(-1))(*args), np.float64)
    assert logits[int(np.asarray(got_id))] >= logits.max() - 2e-2 * np.abs(logits).max()   # within the q8_1 error
    (argmax,) = [ck for ck in jf.compile(*args).kernels if ck.kernel.name == "argmax"]
    assert "if (!vf_last_to_arrive(" in argmax.hip                    # over workgroups (codegen.mapping._across)


def test_a_small_qwen2_prefills_and_decodes_as_on_the_cpu():
    from engine.model import Model
    from stdlib.config import LlamaConfig
    from tests.emu_device import emu_backend
    cfg = LlamaConfig(vocab_size=320, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128, head_dim=16,
                      rope_theta=1e6, norm_eps=1e-6, tie_embeddings=True, qkv_bias=True, arch="qwen2",
                      max_seq_len=16, name="tiny-qwen2")
    D, hd, F = cfg.dim, cfg.head_dim, cfg.ffn_dim
    mat = lambda n, k: (rng.standard_normal((n, k)) * 0.05).astype(np.float16)      # noqa: E731
    vec = lambda n, shift=0.0: (shift + 0.05 * rng.standard_normal(n)).astype(np.float32)  # noqa: E731
    layers = [{"attn_norm": vec(D, 1.0), "ffn_norm": vec(D, 1.0), "wq": mat(4 * hd, D), "wk": mat(2 * hd, D),
               "wv": mat(2 * hd, D), "wo": mat(D, 4 * hd), "w_gate": mat(F, D), "w_up": mat(F, D), "w_down": mat(D, F),
               "bq": vec(4 * hd), "bk": vec(2 * hd), "bv": vec(2 * hd)} for _ in range(cfg.n_layers)]
    params = {"embed": mat(cfg.vocab_size, D), "layers": layers, "norm": vec(D, 1.0)}
    runs = {}
    for backend in ("cpu", emu_backend()):
        m = Model(cfg, params, backend=backend, context=16)
        logits = np.asarray(m.prefill([1, 2, 3]), np.float64)
        runs[backend] = logits, m.decode_greedy(int(np.argmax(logits)), 2)
    (cpu_logits, cpu_ids), (emu_logits, emu_ids) = runs["cpu"], runs["emu"]
    np.testing.assert_allclose(emu_logits, cpu_logits, rtol=0, atol=1e-2 * np.abs(cpu_logits).max())
    assert emu_ids == cpu_ids


def test_verify_checks_the_blocks_a_producer_quantizes_for_the_next_normalization():
    """--verify's checks on the GPU path (engine/verify.py) with q4_0 weights: a GEMV that stores the
    residual x also writes the q8_1 blocks of x * g and their block sums of x * x for the next
    RMSNorm (fusion.q8); both are compared with x's reference (times g, and summed by blocks), and a
    decode of two tokens passes.  Before, the blocks were compared with x alone and failed."""
    from engine.model import Model
    from engine.verify import checking, kernel_checks
    from stdlib.config import LlamaConfig
    from tests.emu_device import emu_backend
    from tests.test_quant_kernels import quantized
    cfg = LlamaConfig(vocab_size=256, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, head_dim=32,
                      rope_theta=1e4, norm_eps=1e-5, tie_embeddings=True, max_seq_len=16, name="tiny-q4_0")
    D, hd, F = cfg.dim, cfg.head_dim, cfg.ffn_dim
    mat = lambda n, k: quantized((n, k), "q4_0", 0.05)                                   # noqa: E731
    vec = lambda n: rng.uniform(0.5, 1.5, n).astype(np.float32)                           # noqa: E731
    layers = [{"attn_norm": vec(D), "ffn_norm": vec(D), "wq": mat(4 * hd, D), "wk": mat(2 * hd, D),
               "wv": mat(2 * hd, D), "wo": mat(D, 4 * hd), "w_gate": mat(F, D), "w_up": mat(F, D),
               "w_down": mat(D, F)} for _ in range(cfg.n_layers)]
    params = {"embed": mat(cfg.vocab_size, D), "layers": layers, "norm": vec(D)}
    m = Model(cfg, params, backend=emu_backend(), context=16)
    normed = [c for c in kernel_checks(m.compile()) for b in c.blocks.values() if b[1]]
    assert normed, "no producer quantizes x * g: the check below would not meet one"
    with checking() as v:
        logits = m.prefill([3, 1, 4])
        for _ in range(2):                     # the decode step, kernel by kernel
            logits = m.decode(int(np.argmax(np.asarray(logits))))
    assert v.calls == 3 and "within tolerance" in v.summary(), v.summary()


@pytest.mark.parametrize("T", [1, 4])
def test_a_gemv_whose_activation_passes_all_lds_runs_from_device_memory(T):
    """K 120000 after an RMSNorm: the f16 activation (240 KB) passes even sm_90's 227 KiB of LDS, so
    each workgroup fills and reads its own slice of a buffer in device memory
    (``codegen.mapping._activation_beyond_lds``); the sm_90 text matches the float64 interpreter."""
    from tests.emu_device import emu_backend
    K, N = 120000, 5
    x, g = rng.standard_normal((T, K)).astype(np.float32), rng.uniform(0.5, 1.5, K).astype(np.float32)
    w = (rng.standard_normal((N, K)) * 0.02).astype(np.float16)
    jf = dsl.jit(lambda x, g, w: nn.linear(nn.rms_norm(x, g, 1e-5), w) * 2.0, backend=emu_backend())
    want = jf.lower(x, g, w).program.run(x, g, w, compute_dtype="f64")[0]
    got = np.asarray(jf(x, g, w), np.float64)
    (ck,) = jf.compile(x, g, w).kernels
    assert re.search(r"vf_half\* const \w+ = \w+_slices \+ \(size_t\)blockIdx.x \* 120000;", ck.hip), ck.hip[:2000]
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-3 * np.abs(want).max())


@pytest.mark.parametrize("fmt,T", [("f16", 1), ("q4_0", 1), ("f16", 4)])
def test_a_gemv_whose_activation_passes_static_lds_runs_from_dynamic_lds(fmt, T):
    """K 27648 (Qwen2.5-32B's down projection) after an RMSNorm: the activation (f16, 55 KB, or q8_1
    blocks with their residual plane, 62 KB; a matmul of 4 rows holds one row at a time) passes
    sm_90's 48 KiB of static LDS, so it is declared in dynamic LDS; the sm_90 text matches the
    float64 interpreter."""
    from tests.emu_device import emu_backend
    from tests.test_quant_kernels import quantized
    K, N = 27648, 24
    x, g = rng.standard_normal((T, K)).astype(np.float32), rng.uniform(0.5, 1.5, K).astype(np.float32)
    w = quantized((N, K), "q4_0", 0.02) if fmt == "q4_0" else (rng.standard_normal((N, K)) * 0.02).astype(np.float16)
    jf = dsl.jit(lambda x, g, w: nn.linear(nn.rms_norm(x, g, 1e-5), w), backend=emu_backend())
    want = jf.lower(x, g, w).program.run(x, g, w, compute_dtype="f64")[0]
    got = np.asarray(jf(x, g, w), np.float64)
    (ck,) = jf.compile(x, g, w).kernels
    (dynamic,) = re.findall(r"VF_DYNAMIC_LDS\(vf_lds, (\d+)\);", ck.hip)
    assert int(dynamic) > 48 * 1024
    tol = 2e-2 if fmt == "q4_0" else 2e-3                 # the q8_1 activation's rounding; f16's
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * np.abs(want).max())


_BARRIERS = """#define VF_WAVE 32
#define VF_ATT_BLOCK 64
#include "{header}"
// each thread's value passed round the workgroup through LDS, a barrier a step, and summed over its wave
static void ring_pass(float* out, int* steps) {{
  __shared__ float lds[64];
  float v = (float)threadIdx.x;
  volatile float big[300000];                             // a local array of 1.2 MB: a fiber's stack holds it
  for (int i = 0; i < 300000; i += 1000) big[i] = v + (float)i;
  v = big[299000] - 299000.0f;
  for (int i = 0; i < *steps; ++i) {{
    if (BROKEN == 1 && threadIdx.x == 5 && i == 3) return;  // a thread that leaves before the barrier
    lds[threadIdx.x] = v;
    __syncthreads();
    v = lds[(threadIdx.x + 1) % 64] + 1.0f;
    if (BROKEN != 2) __syncthreads();                     // without it, a neighbour may write before this read
  }}
  for (int m = 16; m > 0; m /= 2) v += vf_shfl_xor(v, m);
  out[blockIdx.x * 64 + threadIdx.x] = v;
}}
VF_EMULATE(ring_pass, (float*)a[0], (int*)a[1])
"""


@pytest.mark.parametrize("broken", [0, 1, 2], ids=["whole", "a-thread-leaves", "a-barrier-missing"])
def test_the_emulation_passes_values_at_barriers_and_names_a_barrier_that_never_completes(broken, tmp_path):
    """The fibers of ``tests/gpu_emulation.h`` meet at ``__syncthreads`` and the wave's lane exchange
    (values after many barriers against numpy, a local array of 1.2 MB on each fiber's stack); a
    barrier that one thread never reaches stops the emulation with one line on stderr, where a GPU
    (and the emulation with OS threads) would hang; a barrier left out gives wrong values (the fibers
    take turns up and down the workgroup, so a read meets a neighbour's write in both orders)."""
    import subprocess
    import sys
    from tests.emulation import HEADER, compile_shared
    cpp, so = str(tmp_path / "k.cpp"), str(tmp_path / "k.so")
    open(cpp, "w").write(f"#define BROKEN {broken}\n" + _BARRIERS.format(header=HEADER))
    assert compile_shared(cpp, so).returncode == 0
    steps, grid = int(rng.integers(20, 60)), 3
    run = ("import ctypes, sys, numpy as np\n"
           f"lib = ctypes.CDLL({so!r}); out = np.zeros({grid * 64}, np.float32); n = np.array([{steps}], np.int32)\n"
           f"lib.emulate((ctypes.c_void_p * 2)(out.ctypes.data, n.ctypes.data), {grid})\n"
           "np.save(sys.argv[1], out)\n")
    r = subprocess.run([sys.executable, "-c", run, str(tmp_path / "out.npy")], capture_output=True, text=True, timeout=120)
    if broken == 1:
        assert r.returncode != 0 and r.stderr.count("\n") == 1 and "workgroup 0 deadlocks" in r.stderr, r.stderr
        return
    assert r.returncode == 0, r.stderr
    t = np.arange(64)
    v = ((t + steps) % 64 + steps).astype(np.float64)        # thread t ends with thread t + steps's first value
    want = np.tile(np.repeat([v[w * 32:(w + 1) * 32].sum() for w in range(2)], 32), grid)
    got = np.load(tmp_path / "out.npy")
    assert (got != want).any() if broken == 2 else (got == want).all(), (got, want)


def test_a_gemv_in_a_scan_whose_activation_each_thread_keeps_passes_256_kb():
    """A loop body's GEMV keeps its activation in a local array a thread (``mapping._one_workgroup``):
    at K = 66000, 264 KB, more than a small fiber stack held (it crashed the emulation), on the
    emulation against the float64 interpreter."""
    from tests.emu_device import emu_backend
    K = 66000
    w = (rng.standard_normal((K, 4)) / np.sqrt(K)).astype(np.float32)
    xs = rng.standard_normal((2, K)).astype(np.float32)

    def f(w, xs):
        def body(c, x):
            y = (c + x) @ w                                        # (4,)
            return c * 0.5 + dsl.sum(y), y
        return dsl.lax.scan(body, dsl.zeros((K,), dsl.float32), xs)
    jf = dsl.jit(f, backend=emu_backend())
    want = jf.lower(w, xs).program.run(w, xs, compute_dtype="f64")
    got = jf(w, xs)
    for g, e in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float64), e, rtol=0, atol=1e-4 * np.abs(e).max())
