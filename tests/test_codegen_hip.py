"""The HIP renderer: target choices come from the table alone.

Rendering needs no ROCm; compiling is tested in test_hip_inspect.py."""
import re

import numpy as np
import pytest

from codegen import loopir as L
from codegen.hip import prelude, render_hip
from codegen.mapping import map_kernel
from codegen.targets import TARGETS, get_target, occupancy_lds
from tests.decode_step import decode_plan


@pytest.fixture(scope="module")
def kernels():
    return decode_plan().kernels


def test_every_family_of_the_decode_step_renders(kernels):
    fams = {k.family for k in kernels}
    assert {"contract", "attention"} <= fams
    for k in kernels:
        src = render_hip(k, "gfx906").body
        bounds = "VF_ATT_BLOCK" if k.family == "attention" else "VF_BLOCK"
        assert f'extern "C" __global__ void __launch_bounds__({bounds}) {k.name}(' in src
        comments = "\n".join(line for line in src.splitlines() if line.strip().startswith("//"))
        for e in k.eqns:                      # section comments name every fused op and its source line
            assert e.prim.name in comments and e.source in comments, (k.name, e)


def test_a_mapped_kernel_renders_the_same_body_on_every_target(kernels):
    """The mapping (codegen/mapping.py) is made for one target; rendered for another wave width
    or vendor, only the prelude differs, and sm_90's dependent launch adds its requests of L2 for
    the weights before the wait (``vf_prefetch_l2`` lines, named in their comment)."""
    def own(body):
        return "\n".join(line for line in body.splitlines()
                         if "vf_prefetch_l2(" not in line and "into L2, a share per workgroup" not in line)
    for k in kernels[:12]:
        for name in ("gfx906", "sm_90"):
            m = map_kernel(k, get_target(name))
            base = render_hip(m, name)
            for other in (get_target("gfx906", wave=32), get_target("sm_90"), get_target("gfx906")):
                h = render_hip(m, other)
                assert own(h.body) == own(base.body) and (h.grid, h.block) == (base.grid, base.block)
                assert ("vf_prefetch_l2(" in h.body) == (other.pdl and "vf_prefetch_l2(" in render_hip(k, "sm_90").body)
        a, b = render_hip(k, get_target("gfx906", wave=64)), render_hip(k, get_target("gfx906", wave=32))
        assert "#define VF_WAVE 64" in a.source and "#define VF_WAVE 32" in b.source


def test_nvidia_and_amd_preludes_differ_where_the_table_does():
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
        assert "__shared__ vf_half act[" in src               # f16 pairs for v_dot2_f32_f16
        assert "vf_dot8_h(" in src                           # the 16-byte weight path
        m = re.search(r"for \(int (k\d*) = vf_lane \* 8;|const int (k\d*) = vf_lane \* 8 \+ vf_step \* VF_WAVE \* 8;", src)
        k_var = m.group(1) or m.group(2)                     # a loop, or the steps of one unrolled whole
        assert f"act + {k_var})" in src
    nv = render_hip(gemvs[0], "sm_90").body                  # no fp16 dot: the activation stays f32
    assert "__shared__ float act[576]" in nv and "vf_dot8_h(" in nv


def _blocks(src):
    """(condition, enclosing conditions) of every ``if`` in C text, by brace nesting."""
    stack, out = [], []
    for line in src.splitlines():
        s = line.strip()
        cond = re.match(r"(?:} else )?if \((.*)\) {$", s)
        if s.startswith("}"):
            stack.pop()
        if cond:
            out.append((cond.group(1), [c for c in stack if c]))
        if s.endswith("{"):
            stack.append(cond.group(1) if cond else None)
    return out


def test_kernel_text_is_what_a_careful_person_writes(kernels):
    """No preprocessor branch decided at render time, no guard inside the same guard, no one-trip
    loop, no ``- 0`` index noise, wave communication only through prelude helpers, locals named
    after what they hold."""
    for k in kernels:
        body = render_hip(k, "gfx906").body
        assert "#if" not in body and "VF_KSPLIT" not in body, k.name
        assert "__shfl" not in body
        assert not re.search(r"for \(int (\w+) = 0; \1 < 1;", body), k.name
        assert not re.search(r"[-+] 0\b(?!\.)", body), k.name
        assert not re.search(r"(min|max)\(0, 0\)", body), k.name
        for cond, outer in _blocks(body):
            assert cond not in outer, (k.name, cond)
        assert not re.search(r"\b(acc|a|i|n|k)\d\d+\b", body), k.name       # no counters like acc47
    gate_up = next(k for k in kernels if "w_gate" in render_hip(k, "gfx906").body)
    body = render_hip(gate_up, "gfx906").body
    assert "acc_w_gate" in body and "acc_w_up" in body and "sum_sq" in body
    # README (before the typed IR): 104 lines for this kernel's body
    assert len(body.splitlines()) <= 52


def _gemv(K, N, trans_b=True, wdtype="float16", rms=False):
    import dsl
    x = np.random.randn(1, K).astype("f4")
    w = (np.random.randn(N, K) if trans_b else np.random.randn(K, N)).astype(wdtype)
    g = np.random.randn(K).astype("f4")

    def f(x, w, g):
        if rms:
            x = x * dsl.rsqrt(dsl.mean(x * x, -1, keepdims=True) + 1e-5) * g
        return x @ w.T if trans_b else x @ w
    plan = dsl.jit(f).compile(x, w, g).plan
    (k,) = [k for k in plan.kernels if k.family == "contract"]
    return k


def _reduces(k):
    return [s for s in L.walk_stmts(k.body) if isinstance(s, L.Reduce)]


def test_mapping_records_waves_lanes_and_16_byte_loads():
    t = get_target("gfx906")
    m = map_kernel(_gemv(512, 256, rms=True), t)
    loops = [s for s in L.walk_stmts(m.body) if isinstance(s, L.Loop)]
    assert [s.map for s in loops] == ["block", "wave"]        # activation fill, then rows over waves
    pro, dot = _reduces(m)
    assert (pro.map, pro.vector) == ("block", 1)              # the RMSNorm sum of squares
    assert (dot.map, dot.vector, dot.split) == ("lane", 8, 1)
    assert any(isinstance(s, L.Barrier) for s in m.body)
    assert [a.space for a in L.walk_stmts(m.body) if isinstance(a, L.Array)] == ["lds", "lds"]
    assert m.launch.grid == 256 // t.waves_per_block and m.launch.act == "f16"
    assert map_kernel(m, get_target("sm_90")) is m            # mapped once
    f32 = map_kernel(_gemv(512, 256, wdtype="float32"), t)
    assert _reduces(f32)[0].vector == 4                       # 4 floats per 16-byte load


@pytest.mark.parametrize("K, trans_b", [(500, True)])       # a (K, N) weight: tests/test_layout.py
def test_mapping_falls_back_to_scalar_lanes_when_rows_are_not_contiguous(K, trans_b):
    m = map_kernel(_gemv(K, 64, trans_b=trans_b), get_target("gfx906"))
    (dot,) = _reduces(m)
    assert (dot.map, dot.vector) == ("lane", 1)
    src = render_hip(m, "gfx906").body
    assert "vf_dot8_h" not in src and "vf_wave_sum" in src


def test_k_split_only_when_rows_leave_the_chip_idle():
    big = get_target("sm_90")
    m = map_kernel(_gemv(4096, 256), big)                     # 256 rows on 132 SMs: waves share rows
    (dot,) = _reduces(m)
    wave = next(s for s in L.walk_stmts(m.body) if isinstance(s, L.Loop) and s.map == "wave")
    assert dot.split == wave.split == 4
    src = render_hip(m, big).body
    assert src.count("__syncthreads();") == 3 and "vf_part[" in src and "#if" not in src
    (dot,) = _reduces(map_kernel(_gemv(4096, 16384), big))   # enough rows: one wave each
    assert dot.split == 1


def test_the_cpu_renders_the_same_typed_ir():
    """Reduce and Attention reach the LLVM renderer unmapped and run there."""
    k = _gemv(64, 32, rms=True)
    assert k.launch is None and len(_reduces(k)) == 2
    assert not hasattr(k, "meta")


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
    assert expr(L.Cast(L.Sym("x", "f32"), "f16")) == "vf_f2h(x)"
    assert expr(L.Cast(L.Sym("i", "i32"), "f16")) == "vf_f2h((float)(i))"
    assert expr(L.Bin("max", L.Sym("i", "i32"), L.c(0))) == "max(i, 0)"
    assert np.isclose(float(expr(L.Const(0.125, "f32"))[:-1]), 0.125)


def test_expressions_carry_only_the_parentheses_c_needs():
    from codegen.hip import bare, expr
    a, b, c = (L.Sym(x, "f32") for x in "abc")
    add, mul, sub = (lambda x, y, op=op: L.Bin(op, x, y) for op in ("add", "mul", "sub"))
    assert bare(add(add(a, b), c)) == "a + b + c"                  # left to right, as the IR says
    assert bare(add(a, add(b, c))) == "a + (b + c)"                # float addition does not reassociate
    assert bare(mul(add(a, b), c)) == "(a + b) * c" and bare(sub(a, mul(b, c))) == "a - b * c"
    assert expr(L.Un("neg", add(a, b))) == "(-(a + b))" and expr(L.Un("exp", add(a, b))) == "expf(a + b)"
    assert expr(mul(L.Select(L.Bin("lt", a, b), a, b), c)) == "((a < b ? a : b) * c)"
    i = L.Sym("i", "i32")
    assert bare(L.Bin("and", L.Bin("eq", i, L.c(0)), L.Bin("lt", i, L.c(4)))) == "(i == 0) && (i < 4)"


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
    assert "#define VF_WAVE 64" in pre and "#define VF_ATT_BLOCK 256" in pre
    assert 'barrier.sync %0, 64;' in pre and "__shfl_xor_sync" in pre
    for helper in ("vf_shfl_xor(", "vf_shfl_xor_i(", "vf_wave_sync(", "vf_wave_sum(", "vf_block_argmax("):
        assert helper in pre and helper in prelude(TARGETS["gfx906"]) and helper in prelude(TARGETS["sm_90"])
    assert "barrier.sync" not in prelude(TARGETS["sm_90"]) + prelude(TARGETS["gfx906"])


def test_nvidia_wave_width_is_checked():
    with pytest.raises(ValueError, match="emulated_wave=True"):
        prelude(get_target("sm_90", wave=64))
    with pytest.raises(ValueError, match="at most 15 waves"):
        prelude(get_target("sm_90_wave64", attention_block=1024))


def test_elementwise_loops_fill_the_grid_when_locals_are_hoisted_before_them():
    """A KV-cache write computes its clamped position once, before the loop: every thread may
    compute such a local, so the loop still spreads over a grid of workgroups."""
    import dsl
    from engine.pipeline import lower_program
    cache, upd = np.random.randn(8, 512, 128).astype("f4"), np.random.randn(8, 64, 128).astype("f4")
    f = dsl.jit(lambda c, u, pos: dsl.dynamic_update_slice(c, u * 2.0, [0, pos, 0]), donate_argnums=(0,))
    (k,) = [k for k in lower_program(f.lower(cache, upd, 3)).kernels]
    assert any(isinstance(s, L.Declare) for s in k.body)                  # the hoisted clamp
    h = render_hip(k, "gfx906")
    assert h.grid[0] == 8 * 64 * 128 // 256 and "blockIdx.x * VF_BLOCK + threadIdx.x" in h.source


def test_gemv_prologue_fill_is_unrolled_and_weights_address_from_the_row_pointer():
    k = _gemv(1536, 256, rms=True)
    src = render_hip(k, "gfx906").body
    fill = src.index("  act[k")
    assert "#pragma unroll 8" in src[:fill]                      # loads of the fill in flight
    assert re.search(r"vf_dot8_h\(\w+, \w+ \+ row \* 1536 \+ k\d*, act \+ k\d*\)", src)


@pytest.mark.parametrize("sa,sb,dt", [((4, 8), (8, 1), "f4"), ((3, 1), (1, 4), "f4"), ((1, 1), (1, 1), "f2")])
def test_matmuls_with_a_unit_n_or_k_map_and_compile(sa, sb, dt):
    """N = 1 keeps its row loop (a wave per row); K = 1 fills the activation without a loop."""
    import dsl
    from engine.devices.rocm import HipUnavailable, compile_hip
    from engine.pipeline import lower_program
    a, b = np.random.randn(*sa).astype(dt), np.random.randn(*sb).astype(dt)
    for k in lower_program(dsl.jit(lambda a, b: a @ b).lower(a, b)).kernels:
        h = render_hip(k, "gfx906")
        assert "row" in h.body and "act[" in h.body
        try:
            compile_hip(h.source, k.name)
        except HipUnavailable:
            pass


def test_arguments_named_like_c_words_or_prelude_names_still_compile():
    import dsl
    from engine.devices.rocm import HipUnavailable, compile_hip
    from engine.pipeline import lower_program

    def g(int, threadIdx, VF_BLOCK, expf, const, _Float16, asm, vf_x):     # noqa: A002
        return int * threadIdx + VF_BLOCK * expf + const * _Float16 + asm * vf_x
    args = [np.random.randn(8).astype("f4") for _ in range(8)]
    (k,) = lower_program(dsl.jit(g).lower(*args)).kernels
    assert [p.name for p in k.params][:3] == ["int_", "threadIdx_", "VF_BLOCK_"]
    try:
        compile_hip(render_hip(k, "gfx906").source, k.name)
    except HipUnavailable:
        pass


def test_nested_selects_and_operators_keep_their_meaning_in_c():
    """The C spelling of random expressions of selects, comparisons and arithmetic (parentheses only
    where C's precedence needs them) computes what the Loop IR means: compiled by the host's C++
    compiler and run on every input, against Python's evaluation.  A select used as another
    select's condition once lost its parentheses (``c ? true : false ? a : b``)."""
    import itertools
    import random
    import shutil
    import subprocess
    import tempfile
    from codegen import loopir as L
    from codegen.hip import bare
    cxx = shutil.which("c++") or shutil.which("clang++")
    if not cxx:
        pytest.skip("no host C++ compiler")
    rnd = random.Random()
    syms = [L.Sym(n, "i32") for n in "abc"]

    def gen(depth, dtype):
        if depth == 0:
            return rnd.choice(syms) if dtype == "i32" else L.Bin("lt", rnd.choice(syms), L.c(rnd.randint(-1, 1)))
        if dtype == "bool":
            k = rnd.choice(["cmp", "select", "and"])
            if k == "cmp":
                return L.Bin(rnd.choice(["lt", "le", "eq", "ne", "gt"]), gen(depth - 1, "i32"), gen(depth - 1, "i32"))
            if k == "and":
                return L.Bin(rnd.choice(["and", "or"]), gen(depth - 1, "bool"), gen(depth - 1, "bool"))
            return L.Select(gen(depth - 1, "bool"), gen(depth - 1, "bool"), gen(depth - 1, "bool"))
        if rnd.random() < 0.5:
            return L.Select(gen(depth - 1, "bool"), gen(depth - 1, "i32"), gen(depth - 1, "i32"))
        return L.Bin(rnd.choice(["add", "sub", "mul"]), gen(depth - 1, "i32"), gen(depth - 1, "i32"))

    def ev(e, env):
        if isinstance(e, L.Sym):
            return env[e.name]
        if isinstance(e, L.Const):
            return e.value
        if isinstance(e, L.Select):
            return ev(e.a, env) if ev(e.cond, env) else ev(e.b, env)
        a, b = ev(e.a, env), ev(e.b, env)
        return {"lt": a < b, "le": a <= b, "eq": a == b, "ne": a != b, "gt": a > b, "and": a and b, "or": a or b,
                "add": a + b, "sub": a - b, "mul": a * b}[e.op]
    exprs = [gen(3, "i32") for _ in range(40)]
    inputs = list(itertools.product((-2, 0, 1), repeat=3))
    body = "\n".join(f'  std::printf("%d\\n", (int)({bare(e)}));' for e in exprs)
    src = "#include <cstdio>\nint main(int argc, char** argv) {\n  int a, b, c;\n" \
          "  while (std::scanf(\"%d %d %d\", &a, &b, &c) == 3) {\n" + body + "\n  }\n}\n"
    with tempfile.TemporaryDirectory() as d:
        open(f"{d}/t.cpp", "w").write(src)
        subprocess.run([cxx, "-O0", "-w", "-o", f"{d}/t", f"{d}/t.cpp"], check=True)
        out = subprocess.run([f"{d}/t"], input="".join(f"{a} {b} {c}\n" for a, b, c in inputs),
                             capture_output=True, text=True, check=True).stdout.split()
    want = [int(ev(e, dict(zip("abc", v)))) for v in inputs for e in exprs]
    assert [int(x) for x in out] == want
