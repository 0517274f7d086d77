"""The pipeline (engine/pipeline.py): typecheck, debug levels, and the one build-and-cache
(engine/build.py) that every device compiles through.  CPU only; results are checked against
the float64 reference interpreter."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dsl
from codegen.loopir import Bin, Const, Kernel, Load, Loop, Param, Store, Sym
from dsl.core import DSLError
from engine import pipeline
from engine.build import Binary, Compiler, build, render
from engine.codecache import CodeCache
from engine.devices.cpu import CPUDevice, LLVMCompiler
from stdlib import nn

REPO = Path(__file__).resolve().parent.parent
rng = np.random.default_rng()


def randn(*shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def block(x, g, w, r):
    h = nn.rms_norm(x, g, 1e-5)
    return r + nn.silu(nn.linear(h, w))


def block_args():
    return randn(1, 64), randn(64), randn(48, 64, dtype=np.float16), randn(1, 48)


def check_against_reference(jf, args, ex):
    want = jf.lower(*args).program.run(*dsl.tree_flatten(list(args))[0], compute_dtype="f64")
    got = dsl.tree_flatten(ex(*dsl.tree_flatten(list(args))[0]))[0]
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=2e-3, atol=2e-3)


# ----------------------------------------------------------------------------- the pipeline
def test_compile_program_runs_every_pass_and_matches_the_reference(monkeypatch):
    monkeypatch.setenv("VEGAFUSE_PLAN_CACHE", "0")                 # every pass runs, none from the disk cache
    seen = []
    real = pipeline.simplify
    monkeypatch.setattr(pipeline, "simplify", lambda k: seen.append(k.name) or real(k))
    jf = dsl.jit(block, backend="cpu")
    args = block_args()
    ex = pipeline.compile_program(jf, args)
    assert seen == [k.name for k in ex.plan.kernels] and len(ex.kernels) == len(seen) >= 1
    assert [ck.kernel for ck in ex.kernels] == ex.plan.kernels
    check_against_reference(jf, args, ex)
    assert jf.compile(*args).plan.kernels[0].name == ex.plan.kernels[0].name      # dsl.jit takes the same path


def test_a_program_seen_before_takes_its_plan_from_the_disk_cache(tmp_path, monkeypatch):
    """The second lowering of the same program (a warm start) runs no partition or simplifier; the
    plan is equal, its kernels hold the program's own equations; a damaged entry is lowered again."""
    monkeypatch.setenv("VEGAFUSE_CACHE_DIR", str(tmp_path))
    args = block_args()
    first = pipeline.lower_program(dsl.jit(block).lower(*args))
    calls = []
    real = pipeline.simplify
    monkeypatch.setattr(pipeline, "simplify", lambda k: calls.append(k) or real(k))
    low = dsl.jit(block).lower(*args)
    again = pipeline.lower_program(low)
    assert calls == [] and [k.body for k in again.kernels] == [k.body for k in first.kernels]
    assert again.buffers == first.buffers and again.outputs == first.outputs
    assert all(e in low.program.eqns for k in again.kernels for e in k.eqns)
    for entry in tmp_path.rglob("*"):                        # damage every entry: each is lowered again
        if entry.is_file():
            entry.write_bytes(b"garbage")
    third = pipeline.lower_program(dsl.jit(block).lower(*args))
    from codegen.loopir import canonicalize      # lowering again draws fresh local names
    assert calls and [canonicalize(k).body for k in third.kernels] == [canonicalize(k).body for k in first.kernels]
    ex = dsl.jit(block).compile(*args)
    check_against_reference(dsl.jit(block), args, ex)


def test_programs_equal_but_for_their_source_lines_do_not_share_a_plan(tmp_path, monkeypatch):
    """The kernels' comments name the model's lines: a plan cached for one program is not reused
    for another whose IR is the same but whose lines differ."""
    monkeypatch.setenv("VEGAFUSE_CACHE_DIR", str(tmp_path))
    x = np.random.default_rng().standard_normal((4, 8)).astype(np.float32)

    def first(x):
        return dsl.exp(x) * 2.0

    def second(x):

        return dsl.exp(x) * 2.0
    plans = [pipeline.lower_program(dsl.jit(f).lower(x)) for f in (first, second)]
    assert dsl.jit(first).lower(x).as_text() == dsl.jit(second).lower(x).as_text()
    from codegen import loopir as L
    comments = [" ".join(str(s) for k in p.kernels for s in L.walk_stmts(k.body) if isinstance(s, L.Comment))
                for p in plans]
    for plan, comment in zip(plans, comments):
        assert all(e.source in comment for k in plan.kernels for e in k.eqns), comment
    assert comments[0] != comments[1]


def test_reference_backend_has_no_kernels_but_a_plan():
    jf = dsl.jit(block, backend="reference")
    args = block_args()
    ex = pipeline.compile_program(jf, args)
    assert ex.device is None and ex.kernels == [] and ex.plan.kernels
    check_against_reference(jf, args, ex)


# ----------------------------------------------------------------------------- typecheck
def test_typecheck_accepts_traced_and_parsed_programs():
    low = dsl.jit(block).lower(*block_args())
    pipeline.typecheck(low.program)
    pipeline.typecheck(dsl.parse_ir(low.as_text()))


def test_typecheck_names_the_equation_whose_recorded_type_is_wrong():
    jf = dsl.jit(block)
    low = jf.lower(*block_args())
    eqn = next(e for e in low.program.eqns if e.prim.name == "logistic")
    eqn.out.shape = (1, 47)                                   # the rule gives (1, 48)
    with pytest.raises(DSLError) as ei:
        low.compile()
    msg = str(ei.value)
    assert msg.startswith(eqn.source) and "logistic: output recorded as f32[1,47] but the rule gives f32[1,48]" in msg
    assert "\n" not in msg


def test_typecheck_finds_use_before_definition_and_undefined_outputs():
    prog = dsl.parse_ir("{ lambda a:f32[3] ;\n  let b:f32[3] = exp a\n      c:f32[3] = mul b a\n  in ( c ) }")
    prog.eqns.reverse()
    with pytest.raises(DSLError, match=r"equation 0: mul: input f32\[3\] is used before any equation defines it"):
        pipeline.typecheck(prog)
    prog.eqns.reverse()
    prog.outputs.append(dsl.core.Var((2,), "f32"))
    with pytest.raises(DSLError, match=r"program output 1 \(f32\[2\]\) is neither an input nor computed"):
        pipeline.typecheck(prog)


# ----------------------------------------------------------------------------- debug levels
def compile_with_debug(level, monkeypatch, capsys):
    monkeypatch.setenv("VEGAFUSE_DEBUG", str(level))
    jf = dsl.jit(block, backend="cpu")
    args = block_args()
    capsys.readouterr()
    ex = jf.compile(*args)
    err = capsys.readouterr().err
    check_against_reference(jf, args, ex)
    jf.compile(*args)                                         # cached: nothing printed again
    assert capsys.readouterr().err == ""
    return ex, err


@pytest.mark.parametrize("level", [1, 2, 3, 4])
def test_debug_levels(level, monkeypatch, capsys):
    ex, err = compile_with_debug(level, monkeypatch, capsys)
    k = ex.plan.kernels[0]
    n = len(ex.plan.kernels)
    total = sum(k.bytes for k in ex.plan.kernels)
    assert err.startswith(f"vegafuse: {n} kernel{'s' * (n != 1)} on cpu, {total:,} bytes")
    assert re.search(rf"^  {re.escape(k.name)} +{k.family} +{k.bytes:,} +{k.flops:,} ", err, re.M), err
    assert ("--- Loop IR" in err and f"kernel {k.name} [{k.family}](" in err) == (level >= 2)
    assert ("--- source" in err and f'define void @"{k.name}"' in err) == (level >= 3)
    sym = ex.kernels[0].symbol
    assert ("--- ISA" in err and re.search(rf"^{sym}:", err, re.M) is not None) == (level >= 4)
    if level >= 4:
        assert re.search(r"^\s+(ret|retq)\b", err, re.M)       # host assembly, not IR


def test_debug_off_prints_nothing_and_bad_levels_are_one_line(monkeypatch, capsys):
    monkeypatch.setenv("VEGAFUSE_DEBUG", "0")
    dsl.jit(block)(*block_args())
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("VEGAFUSE_DEBUG", "verbose")
    with pytest.raises(ValueError, match=r"^VEGAFUSE_DEBUG='verbose' is not a debug level; use 0 \(off\) to 4$"):
        dsl.jit(block).compile(*block_args())


# ----------------------------------------------------------------------------- build
def scale_kernel(name, factor, n=37):
    i = Sym("i", "i32")
    params = (Param("x", "f32", shape=(n,)), Param(f"{name}_out", "f32", shape=(n,), role="out"))
    return Kernel(name, "elementwise", params,
                  (Loop("i", Const(0, "i32"), Const(n, "i32"),
                        (Store(f"{name}_out", i, Bin("mul", Load("x", i, "f32"), Const(factor, "f32"))),), True),),
                  bytes=8 * n, flops=n)


class CountingCompiler(Compiler):
    """A stand-in compiler: the 'code' is the source's bytes; counts compiles."""
    jobs = 4
    identity = {"kind": "test", "compiler": "counting 1"}

    def __init__(self, fail_on=None):
        super().__init__()
        self.calls, self.fail_on = [], fail_on

    def render(self, kernel):
        return f"// {kernel.name}\n{kernel.body!r}"

    def compile(self, source, name):
        if self.fail_on and self.fail_on in source:
            raise RuntimeError(f"kernel {name}: cannot compile")
        self.calls.append(name)
        return source.encode()


def test_build_compiles_each_distinct_kernel_once_and_caches_on_disk(tmp_path):
    kernels = [scale_kernel(f"layer{i}", 2.0) for i in range(5)] + [scale_kernel(f"other{i}", 3.0) for i in range(3)]
    cache, comp = CodeCache(tmp_path), CountingCompiler()
    sources = render(kernels, comp)
    assert len({s.text for s in sources}) == 2 and sources[1].readable.startswith("// layer1")
    binaries = build(sources, comp, cache)
    assert sorted(comp.calls) == ["layer0", "other0"] and cache.stats["misses"] == 2
    assert binaries[0] is binaries[4] and binaries[0] is not binaries[5]
    assert all(isinstance(b, Binary) and b.code == s.text.encode() for s, b in zip(sources, binaries))
    assert build(sources, comp, cache)[0] is binaries[0] and cache.stats["hits"] == 0    # kept in memory
    fresh = CountingCompiler()                                                         # a new process, say
    again = build(render(kernels, fresh), fresh, cache)
    assert fresh.calls == [] and cache.stats["hits"] == 2 and all(b.cache_hit for b in again)


def test_build_error_names_the_kernel_and_stores_nothing(tmp_path):
    cache, comp = CodeCache(tmp_path), CountingCompiler(fail_on="3.0")
    with pytest.raises(RuntimeError, match="kernel bad: cannot compile"):
        build(render([scale_kernel("good", 2.0), scale_kernel("bad", 3.0)], comp), comp, cache)
    assert len(list(tmp_path.glob("objects/*/*.bin"))) <= 1                          # only the good one


def test_cpu_objects_from_the_disk_cache_run_and_corrupt_ones_are_rebuilt(tmp_path):
    cache = CodeCache(tmp_path)
    k = scale_kernel("scale", 1.5)
    first = LLVMCompiler()
    (b0,) = build(render([k], first), first, cache)
    (entry,) = tmp_path.glob("objects/*/*.bin")
    blob = entry.read_bytes()
    entry.write_bytes(blob[:len(blob) // 2])
    second = LLVMCompiler()
    (b1,) = build(render([k], second), second, cache)
    assert not b1.cache_hit and cache.stats["corrupt"] == 1 and entry.read_bytes() == blob
    third = LLVMCompiler()
    sources = render([k], third)
    (b2,) = build(sources, third, cache)
    assert b2.cache_hit and b2.code == b0.code and b2.entry == b0.entry
    (ck,) = CPUDevice().load(sources, [b2])
    x, out = randn(37), np.full(37, np.nan, np.float32)
    ck({"x": x, "scale_out": out})
    np.testing.assert_allclose(out, x.astype(np.float64) * 1.5, rtol=1e-6)


CHILD = r"""
import json, os, sys
import numpy as np
import dsl
from engine.build import code_cache
from engine.devices import cpu
from tests.test_pipeline import block
if sys.argv[1] == "nobuild":
    def forbidden(self, source, name):
        raise AssertionError(f"compiled {name} although the cache should have hit")
    cpu.LLVMCompiler.compile = forbidden
rng = np.random.default_rng(0)
args = (rng.standard_normal((1, 64)).astype("f4"), rng.standard_normal(64).astype("f4"),
        rng.standard_normal((48, 64)).astype("f2"), rng.standard_normal((1, 48)).astype("f4"))
y = dsl.jit(block, backend="cpu")(*args)
print(json.dumps({"stats": code_cache().stats, "y": np.asarray(y).tolist()}))
"""


def test_second_process_compiles_nothing(tmp_path):
    env = dict(os.environ, VEGAFUSE_CACHE_DIR=str(tmp_path), VEGAFUSE_DEBUG="0")
    runs = []
    for mode in ("build", "nobuild"):
        p = subprocess.run([sys.executable, "-c", CHILD, mode], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    assert runs[0]["stats"]["misses"] >= 1 and runs[0]["stats"]["hits"] == 0
    assert runs[1]["stats"]["misses"] == 0 and runs[1]["stats"]["hits"] == runs[0]["stats"]["misses"]
    assert runs[0]["y"] == runs[1]["y"]


def test_architecture_doc_opens_with_the_pipeline_as_written():
    doc = (REPO / "docs" / "architecture.md").read_text()
    code = (REPO / "engine" / "pipeline.py").read_text()
    snippet = doc.split("```python\n", 1)[1].split("```", 1)[0]
    assert doc.index("```python") < doc.index("**Trace.**") and "def compile_program" in snippet
    for line in snippet.splitlines():
        assert line in code.splitlines(), f"docs/architecture.md shows a line that engine/pipeline.py lacks: {line!r}"


class FakeNVRTC:
    """Stands in for cuda.bindings.nvrtc and .driver (no GPU here): records compiles; the 'cubin'
    is the source's hash."""

    def __init__(self):
        self.compiled, self.loaded = [], []

    def nvrtcVersion(self):
        return 0, 12, 4

    def nvrtcCreateProgram(self, src, name, n, headers, names):
        return 0, (src, name)

    def nvrtcCompileProgram(self, prog, n, opts):
        self.compiled.append((prog[1].decode(), [o.decode() for o in opts]))
        self.cubin = __import__("hashlib").sha256(prog[0]).digest()
        return (0,)

    def nvrtcGetCUBINSize(self, prog):
        return 0, len(self.cubin)

    def nvrtcGetCUBIN(self, prog, buf):
        return (0,)

    def cuModuleLoadData(self, code):
        self.loaded.append(code)
        return 0, f"module{len(self.loaded)}"

    def cuModuleGetFunction(self, module, name):
        return 0, (module, name.decode())


def test_cuda_device_builds_through_the_shared_path(tmp_path, monkeypatch):
    """The CUDA device's compile path without a GPU: NVRTC and the driver are stand-ins."""
    from codegen.targets import get_target
    from engine.devices.cuda import CUDADevice
    from tests.decode_step import decode_plan
    monkeypatch.setenv("VEGAFUSE_CACHE_DIR", str(tmp_path))
    kernels = decode_plan().kernels[:8]

    def device():
        dev = CUDADevice.__new__(CUDADevice)
        dev.nvrtc = dev.drv = FakeNVRTC()
        dev.target, dev.arch, dev._compiler, dev._functions = get_target("sm_90"), "sm_90", None, {}
        return dev
    dev = device()
    cks = dev.compile_many(kernels)
    distinct = len({s.text for s in render(kernels, dev.compiler)})
    assert len(dev.nvrtc.compiled) == len(dev.nvrtc.loaded) == distinct < len(kernels)
    name, opts = dev.nvrtc.compiled[0]
    assert name == f"{kernels[0].name}.cu" and opts[:2] == ["--gpu-architecture=sm_90", "--std=c++17"]
    twin = next(i for i, k in enumerate(kernels) if k.name == kernels[1].name.replace("layers_0", "layers_1"))
    assert [ck.kernel for ck in cks] == kernels and cks[1].function is cks[twin].function     # layers share
    assert cks[1].function[1] == "canonical" and kernels[1].name in cks[1].source
    assert "__shfl_xor_sync" in cks[0].source                                # the NVIDIA flavour
    again = device()
    again.compile_many(kernels)
    assert again.nvrtc.compiled == [] and len(again.nvrtc.loaded) == distinct    # the disk cache
    wave64 = device()
    wave64.target = get_target("sm_90_wave64")                              # a new target: a new compiler
    wave64.compile_many(kernels[:1])
    assert wave64.compiler.target.wave == 64 and len(wave64.nvrtc.compiled) == 1
    assert wave64.nvrtc.compiled[0][1][0] == "--gpu-architecture=sm_90"     # the device's arch, not the flavour's name


def test_cpu_compile_error_names_the_kernel_and_the_line():
    bad = 'define void @"canonical"(ptr %a) {\nentry:\n  %x = add i32 1, %nope\n  ret void\n}\n'
    with pytest.raises(RuntimeError) as ei:
        LLVMCompiler().compile(bad, "k007_demo")
    msg = str(ei.value)
    assert msg.startswith("LLVM kernel 'k007_demo' failed to compile")
    assert ":3:19: error: use of undefined value '%nope'" in msg


def test_debug_level_4_prints_gfx906_isa(tmp_path, monkeypatch):
    """The GPU side of the debug levels, on an offline gfx906 device (hiprtc, no GPU)."""
    from engine.devices.rocm import HipUnavailable, find_hiprtc
    try:
        find_hiprtc()
        from codegen.codeobject import find_llvm_tool
        find_llvm_tool("llvm-objdump")
    except HipUnavailable as e:
        pytest.skip(str(e))
    from engine.devices.hip import HIPDevice
    monkeypatch.setenv("VEGAFUSE_CACHE_DIR", str(tmp_path))
    low = dsl.jit(block).lower(*block_args())
    plan = pipeline.lower_program(low)
    dev = HIPDevice.offline()
    sources = render(plan.kernels, dev.compiler)
    text = pipeline.debug_report(4, plan, sources, build(sources, dev.compiler), dev)
    k = plan.kernels[0]
    assert text.startswith(f"vegafuse: {len(plan.kernels)} kernel") and "on hip" in text
    assert f'extern "C" __global__' in text and k.name in text                 # the HIP source
    assert "v_dot2_f32_f16" in text and "s_endpgm" in text                     # gfx906 ISA


@pytest.mark.parametrize("text,msg", [
    ("{ lambda a:f64[2,3] ; let b:f64[2,3] = exp a in ( b ) }", "f64 is not supported"),
    ("{ lambda a:f32[2,3] ; let b:f32[0,3] = slice[limit=(1,3), start=(1,0)] a in ( b ) }", "zero-size"),
    ("{ lambda a:f32[4294967297] ; let b:f32[4294967297] = exp a in ( b ) }", "32 bits"),
])
def test_typecheck_rejects_what_no_kernel_can_run(text, msg):
    from engine.pipeline import typecheck
    with pytest.raises(DSLError, match=msg):
        typecheck(dsl.parse_ir(text))


def test_a_cpu_cache_entry_with_the_wrong_object_is_rebuilt_not_loaded(tmp_path, monkeypatch):
    """An entry that passes its checksum but holds another kernel's object, or garbage, would
    crash the JIT when loaded: it is rebuilt instead."""
    from engine import codecache
    from engine.build import compile_source, render
    from engine.executable import get_device
    from engine.pipeline import lower_program
    monkeypatch.setenv("VEGAFUSE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("VEGAFUSE_PLAN_CACHE", "0")                 # only kernel objects in this cache
    monkeypatch.setenv("VEGAFUSE_RENDER_CACHE", "0")
    x = np.random.default_rng().standard_normal(7).astype("f4")
    dev = get_device("cpu")
    srcs = [render(lower_program(dsl.jit(fn).lower(x)).kernels, dev.compiler)[0]
            for fn in (lambda x: dsl.exp(x) * 2.0 + 1.0, lambda x: dsl.sin(x) - 3.0)]
    first = [compile_source(dev.compiler, s.text, s.kernel.name) for s in srcs]
    files = sorted(tmp_path.glob("objects/*/*.bin"))
    assert len(files) == 2 and not any(b.cache_hit for b in first)
    files[0].write_bytes(files[1].read_bytes())                   # another kernel's object
    files[1].write_bytes(codecache.pack_entry(b"garbage"))         # a checksummed garbage payload
    again = [compile_source(dev.compiler, s.text, s.kernel.name) for s in srcs]
    assert not any(b.cache_hit for b in again)
    assert [b.code for b in again] == [b.code for b in first]
    assert all(dev.compiler.holds(b.code, b.entry) for b in again)
    third = [compile_source(dev.compiler, s.text, s.kernel.name) for s in srcs]
    assert all(b.cache_hit for b in third)                        # the rebuilt entries were stored


def test_inspect_refuses_contexts_beyond_the_model_and_source_without_a_kernel():
    for args, msg in ((["--context", "99999999"], "beyond the model's"), (["--source"], "--kernel NAME")):
        r = subprocess.run([sys.executable, "-m", "codegen.inspect", *args], cwd=Path(__file__).resolve().parent.parent,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_attention_needs_the_queries_to_fit_the_cache():
    q, k = np.random.randn(2, 8, 16).astype("f4"), np.random.randn(1, 4, 16).astype("f4")
    with pytest.raises(DSLError, match="do not fit a cache of 4"):
        dsl.jit(lambda q, k, v, pos: dsl.attention(q, k, v, pos, 0.25)).lower(q, k, k, 0)
