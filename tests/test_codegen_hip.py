"""The HIP renderer: target choices come from the table alone.

Rendering needs no ROCm; compiling is tested in test_hip_inspect.py."""
import numpy as np
import pytest

from codegen.hip import prelude, render_hip
from codegen.targets import TARGETS, get_target, occupancy_lds
from tests.decode_step import decode_plan


@pytest.fixture(scope="module")
def kernels():
    return decode_plan().kernels


def test_every_family_of_the_decode_step_renders(kernels):
    fams = {k.family for k in kernels}
    assert {"contract", "attention", "elementwise"} <= fams
    for k in kernels:
        src = render_hip(k, "gfx906").source
        bounds = "VF_ATT_BLOCK" if k.family == "attention" else "VF_BLOCK"
        assert f'extern "C" __global__ void __launch_bounds__({bounds}) {k.name}(' in src
        for op in k.ops:                                   # the header lists every fused op with its shape
            assert op in src


def test_wave_width_comes_only_from_the_table(kernels):
    """Rendered at wave 64 and at wave 32, every kernel differs only in the VF_WAVE line."""
    for k in kernels:
        a = render_hip(k, get_target("gfx906", wave=64)).source.splitlines()
        b = render_hip(k, get_target("gfx906", wave=32)).source.splitlines()
        diff = [(x, y) for x, y in zip(a, b) if x != y]
        assert len(a) == len(b)
        # only the table's defines (the wave width, and the waves per GEMV row derived from it)
        # and the prelude's comment naming the wave width differ
        rest = [x for x, _ in diff if not x.startswith(("// target", "#define VF_KSPLIT"))]
        assert rest == ["#define VF_WAVE 64"], diff


def test_nvidia_flavour_differs_only_in_the_prelude(kernels):
    for k in kernels:
        amd, nv = render_hip(k, "gfx906"), render_hip(k, "sm_90")
        assert amd.body == nv.body                          # the kernel text is shared
        assert amd.source[:amd.body_start] != nv.source[:nv.body_start]
    amd, nv = prelude(TARGETS["gfx906"]), prelude(TARGETS["sm_90"])
    assert "#define VF_WAVE 64" in amd and "#define VF_WAVE 32" in nv
    assert "__builtin_amdgcn_fdot2" in amd and "fdot2" not in nv
    assert "__shfl_xor_sync" in nv and "__shfl_xor_sync" not in amd
    assert "hip_fp16.h" not in amd                          # clashes with hiprtc's built-in header


def test_gemv_keeps_the_activation_in_lds_and_loads_16_bytes(kernels):
    gemvs = [k for k in kernels if k.family == "contract"]
    assert len(gemvs) >= 4 * 30
    for k in gemvs[:6]:
        src = render_hip(k, "gfx906").body
        assert "__shared__ vf_act_t vf_act[K_]" in src
        assert "vf_dot8_h(" in src                           # the 16-byte weight path
        loop = src[src.index("for (int vf_k"):]
        assert "vf_act + vf_k" in loop


def test_occupancy_cap_requests_lds_so_at_most_9_waves_per_simd():
    t = get_target("gfx906")
    lds = occupancy_lds(t)
    wgs_per_cu = t.lds_per_cu // lds
    assert wgs_per_cu * t.waves_per_block / t.simds_per_cu <= 9
    assert occupancy_lds(get_target("gfx906", max_waves_per_simd=0)) == 0    # the named switch


def test_const_and_cast_rendering():
    from codegen import loopir as L
    from codegen.hip import expr
    assert expr(L.Const(float("-inf"), "f32")) == "(-VF_INF)"
    assert expr(L.Const(1e-05, "f32")) == "1e-05f"
    assert expr(L.Cast(L.Load("w", L.c(3), "f16"), "f32")) == "vf_h2f(w[3])"
    assert expr(L.Cast(L.Sym("x", "f32"), "f16")) == "vf_f2h((float)(x))"
    assert expr(L.Bin("max", L.Sym("i", "i32"), L.c(0))) == "max(i, 0)"
    assert np.isclose(float(expr(L.Const(0.125, "f32"))[:-1]), 0.125)


def test_emulated_wave64_runs_the_gfx906_kernel_text(kernels):
    """The NVIDIA wave-64 flavour (two warps per wave) renders gfx906's kernel text byte for byte;
    only the prelude differs, and there the cross-warp exchange uses a named barrier per wave."""
    t = get_target("sm_90_wave64")
    assert t.wave == 64 and t.emulated_wave and t.attention_block // t.wave <= 15
    for k in kernels:
        amd, nv = render_hip(k, "gfx906"), render_hip(k, t)
        assert amd.body == nv.body, k.name
        assert nv.block[0] // 64 <= 15                       # named barrier ids 1..15
    pre = prelude(t)
    assert "#define VF_WAVE 64" in pre and "#define VF_ATT_BLOCK 512" in pre
    assert 'barrier.sync %0, 64;' in pre and "__shfl_xor_sync" in pre
    for helper in ("vf_shfl_xor(", "vf_shfl_xor_i(", "vf_wave_sync(", "vf_wave_sum(", "vf_block_argmax("):
        assert helper in pre and helper in prelude(TARGETS["gfx906"]) and helper in prelude(TARGETS["sm_90"])
    assert "barrier.sync" not in prelude(TARGETS["sm_90"]) + prelude(TARGETS["gfx906"])


def test_nvidia_wave_width_is_checked():
    with pytest.raises(ValueError, match="emulated_wave=True"):
        prelude(get_target("sm_90", wave=64))
    with pytest.raises(ValueError, match="at most 15 waves"):
        prelude(get_target("sm_90_wave64", attention_block=1024))
