"""The HIP device (engine/devices/hip.py): complete but untested on hardware.

Without an AMD GPU this checks what can be checked:

* ``HIPDevice()`` raises ``HipUnavailable`` with a clear message (and so does ``backend="hip"``);
* ``HIPDevice.offline()`` compiles fused decode-step kernels through hiprtc, kernels equal up to
  names share one code object, and the launch arguments match the code objects' metadata;
* the device's glue (memory, scalar slots, launches, plans, graph capture, the executable) runs
  against a stand-in for hip-python that keeps "device" memory on the host and records launches
  instead of running them.

The tests at the end run kernels and SmolLM2 on a real AMD GPU; they skip where there is none,
and have never run (no AMD GPU was available when they were written).
"""
import ctypes
import types

import numpy as np
import pytest

from codegen.codeobject import CodeObject
from engine.devices import hip as H
from engine.devices.rocm import HipUnavailable, find_hiprtc

try:
    find_hiprtc()
except HipUnavailable as e:
    pytest.skip(str(e), allow_module_level=True)

from rocm.bindings import hip as real_hip  # noqa: E402

import dsl  # noqa: E402
import rocm.bindings  # noqa: E402
from engine import executable  # noqa: E402
from engine.devices.gpu import DeviceArray, Plan  # noqa: E402
from stdlib import nn  # noqa: E402
from tests.decode_step import decode_plan  # noqa: E402

OK = real_hip.hipError_t.hipSuccess


def gpu_present():
    try:
        H.HIPDevice()
        return True
    except HipUnavailable:
        return False


HAVE_GPU = gpu_present()


@pytest.fixture
def cache_dir(tmp_path_factory, monkeypatch):
    d = tmp_path_factory.getbasetemp() / "hip-device-cache"           # shared by this session's tests
    monkeypatch.setenv("VEGAFUSE_CACHE_DIR", str(d))
    return d


@pytest.fixture(scope="module")
def kernels():
    return decode_plan().kernels[:8]


# ----------------------------------------------------------------------------- no GPU
@pytest.mark.skipif(HAVE_GPU, reason="an AMD GPU is present")
def test_no_gpu_is_a_clear_error():
    with pytest.raises(HipUnavailable, match="no AMD GPU visible to HIP") as ei:
        H.HIPDevice()
    msg = str(ei.value)
    assert "hipGetDeviceCount" in msg and "HIPDevice.offline()" in msg and "cpu backend" in msg
    executable._DEVICES.pop("hip", None)
    with pytest.raises(HipUnavailable, match="no AMD GPU"):
        executable.get_device("hip")
    assert "hip" not in executable._DEVICES
    with pytest.raises(HipUnavailable, match="no AMD GPU"):
        dsl.jit(lambda x: x * 2.0, backend="hip")(np.ones(4, np.float32))


def test_runtime_failure_and_zero_devices_are_clear_errors(monkeypatch):
    def broken():
        raise RuntimeError("cannot open libamdhip64.so")
    monkeypatch.setattr(rocm.bindings, "hip", types.SimpleNamespace(hipGetDeviceCount=broken))
    with pytest.raises(HipUnavailable, match="HIP runtime failed to start.*cannot open libamdhip64"):
        H.HIPDevice()
    monkeypatch.setattr(rocm.bindings, "hip", types.SimpleNamespace(hipGetDeviceCount=lambda: (OK, 0)))
    with pytest.raises(HipUnavailable, match="no AMD GPU visible to HIP .*hipSuccess, 0 devices"):
        H.HIPDevice()
    monkeypatch.setattr(rocm.bindings, "hip", types.SimpleNamespace(hipGetDeviceCount=lambda: (OK, 1)))
    with pytest.raises(HipUnavailable, match="no HIP device 3: 1 AMD GPU"):
        H.HIPDevice(3)


def test_offline_device_refuses_gpu_work():
    dev = H.HIPDevice.offline()
    assert not dev.online and not dev.graphs and "offline" in repr(dev)
    with pytest.raises(HipUnavailable, match="hipMalloc: this HIPDevice was made by HIPDevice.offline"):
        dev.empty((4,), "f32")


def test_graphs_are_off_by_default_and_a_switch(monkeypatch):
    monkeypatch.delenv("VEGAFUSE_HIP_GRAPHS", raising=False)
    assert H.HIPDevice.offline().graphs is False
    assert "slower" in H.HIPDevice.__doc__ and "leaking" in H.HIPDevice.__doc__
    monkeypatch.setenv("VEGAFUSE_HIP_GRAPHS", "1")
    dev = H.HIPDevice.offline()
    assert dev.graphs is True and dev.plan([]).graphs is True


# ----------------------------------------------------------------------------- compiling, no GPU
def test_compile_many_decode_kernels(cache_dir, kernels):
    dev = H.HIPDevice.offline()
    cks = dev.compile_many(kernels)
    assert [ck.kernel for ck in cks] == list(kernels)
    for k, ck in zip(kernels, cks):
        assert isinstance(ck.binary, CodeObject) and ck.binary.arch == "gfx906"
        assert ck.binary.kernel_symbols() == ["canonical"]
        assert ck.function is None                                 # offline: nothing loaded
        assert f'extern "C" __global__' in ck.source and k.name in ck.source   # readable source
        r = ck.binary.resources(workgroup_size=ck.hip.block[0], dynamic_lds_bytes=ck.hip.dynamic_lds)
        assert r["lds_bytes"] + ck.hip.dynamic_lds <= 65536 and r["max_workgroup_size"] >= ck.hip.block[0]
    assert cks[0].hip.target.name == "gfx906" and cks[0].hip.target.wave == 64


def test_kernels_equal_up_to_names_share_one_code_object(cache_dir, kernels):
    from codegen.hip import render_hip
    from codegen.loopir import canonicalize
    dev = H.HIPDevice.offline()
    cks = dev.compile_many(kernels)
    a, b = cks[1], cks[6]                               # layer 0's and layer 1's attention
    assert a.kernel.name != b.kernel.name and a.source != b.source
    assert a.binary is b.binary
    canon = {render_hip(canonicalize(k), "gfx906").source for k in kernels}
    assert len({id(ck.binary) for ck in cks}) == len(canon) == len(dev._functions) == 7
    again = dev.compile_many(kernels)                   # loaded once per device
    assert all(x.binary is y.binary for x, y in zip(cks, again))
    fresh = H.HIPDevice.offline().compile_many(kernels[:1])       # another device: the disk cache
    assert fresh[0].binary.cache_hit and fresh[0].binary == cks[0].binary


def test_compile_checks_the_argument_layout(cache_dir, kernels):
    dev = H.HIPDevice.offline()
    ck = dev.compile_many(kernels[1:2])[0]
    fake = types.SimpleNamespace(name="k999_mismatch", params=ck.kernel.params[:-1])
    with pytest.raises(H.HipError, match="kernel k999_mismatch: the code object's arguments"):
        dev._check_abi(ck.binary, ck.hip, fake)
    big = types.SimpleNamespace(block=(2048, 1, 1), dynamic_lds=0)
    with pytest.raises(H.HipError, match=f"kernel {ck.kernel.name}: launched with 2048 threads"):
        dev._check_abi(ck.binary, big, ck.kernel)


class Slots:
    """Scalar slots at a made-up device address, as ``prepare`` sees them."""
    base = 0x7F0000001000

    def __init__(self, names):
        self.index = {n: i for i, n in enumerate(names)}

    def ptr(self, name):
        return self.base + 4 * self.index[name]


def fake_buffers(dev, kernel, base=0x7E0000000000):
    return {p.name: DeviceArray(dev, base + 0x100000 * i, p.shape, H.NP_DTYPES[p.dtype])
            for i, p in enumerate(kernel.params) if p.kind == "buffer"}


def test_argument_packing(cache_dir, kernels):
    dev = H.HIPDevice.offline()
    ck = dev.compile_many(kernels[1:2])[0]                # RoPE + KV write: buffers and the scalar pos
    params = ck.kernel.params
    assert [p.kind for p in params].count("scalar") == 1
    bufs, slots = fake_buffers(dev, ck.kernel), Slots(["pos", "last"])
    launch = dev.prepare(ck, bufs, slots)
    want = [slots.ptr(p.name) if p.kind == "scalar" else bufs[p.name].ptr for p in params]
    assert [int(v) for v in launch.values] == want
    # kernelParams: the address of each value, in parameter order
    assert [int(a) for a in launch.args] == [launch.values.ctypes.data + 8 * i for i in range(len(params))]
    assert [ctypes.c_uint64.from_address(int(a)).value for a in launch.args] == want
    # the kernarg segment the runtime builds from them, laid out by the code object's metadata
    meta = ck.binary.kernel_metadata("canonical")
    explicit = [a for a in meta[".args"] if not a[".value_kind"].startswith("hidden_")]
    assert [(a[".offset"], a[".size"]) for a in explicit] == [(8 * i, 8) for i in range(len(params))]
    assert dev.kernargs(launch) == b"".join(v.to_bytes(8, "little") for v in want)
    # a wrong or missing buffer names the kernel and the buffer
    name = next(p.name for p in params if p.kind == "buffer")
    wrong = dict(bufs, **{name: DeviceArray(dev, 0x1000, (3,), np.float32)})
    with pytest.raises(H.HipError, match=f"kernel {ck.kernel.name}: buffer {name!r} is float32\\[3\\]"):
        dev.prepare(ck, wrong, slots)
    with pytest.raises(H.HipError, match=f"kernel {ck.kernel.name}: buffer {name!r} missing"):
        dev.prepare(ck, {k: v for k, v in bufs.items() if k != name}, slots)


def test_fill_values_follow_the_cuda_fill_formula():
    def reference(i, seed, scale, shift):                 # vf_fill in engine/devices/cuda.py, in Python
        m = 0xFFFFFFFF
        h = ((i * 2654435761) & m) ^ seed
        h ^= h >> 16
        h = (h * 0x7FEB352D) & m
        h ^= h >> 15
        h = (h * 0x846CA68B) & m
        h ^= h >> 16
        return np.float32(shift) + np.float32(scale) * (np.float32(2.0) * np.float32(h >> 8)
                                                        * np.float32(1 / 16777216) - np.float32(1.0))
    idx = [0, 1, 2, 77, 1 << 20, (1 << 32) + 5, 123456789]
    got = np.concatenate([H.fill_values(i, 1, 9, 0.5, 1.0) for i in idx])
    np.testing.assert_array_equal(got, np.array([reference(i, 9, 0.5, 1.0) for i in idx], np.float32))
    v = H.fill_values(0, 100000, 3, 0.02, 1.0)
    assert v.dtype == np.float32 and v.min() >= 0.98 and v.max() < 1.02 and abs(v.mean() - 1.0) < 1e-3
    assert not np.array_equal(v, H.fill_values(0, 100000, 4, 0.02, 1.0))


# ----------------------------------------------------------------------------- the glue, on a stand-in runtime
class FakeHip:
    """hip-python's calls used by HIPDevice, with hip-python's signatures and return tuples, over
    host memory.  Launches are recorded (with the values their scalar pointers point at), not run."""

    hipError_t = real_hip.hipError_t
    hipStreamCaptureMode = real_hip.hipStreamCaptureMode

    def __init__(self):
        self.mem, self.launches, self.calls = {}, [], []
        self.capturing, self.graphs = None, []

    def _alloc(self, n):
        buf = ctypes.create_string_buffer(n)
        self.mem[ctypes.addressof(buf)] = buf
        return ctypes.addressof(buf)

    def _owned(self, ptr, n):
        assert any(a <= ptr and ptr + n <= a + len(b) for a, b in self.mem.items()), f"{ptr:#x}+{n} not allocated"

    def hipGetDeviceCount(self):
        return OK, 1

    def hipSetDevice(self, i):
        return (OK,)

    def hipStreamCreate(self):
        return OK, "stream0"

    def hipMalloc(self, n):
        return OK, self._alloc(n)

    def hipHostMalloc(self, n, flags):
        assert flags == 0
        return OK, self._alloc(n)

    def hipFree(self, ptr):
        self.mem.pop(int(ptr), None)
        return (OK,)

    def hipMemsetD8Async(self, p, v, n, stream):
        assert stream == "stream0"
        self._owned(p, n)
        ctypes.memset(p, v, n)
        return (OK,)

    def _copy(self, name, dst, src, n, stream=None):
        self.calls.append(name)
        ctypes.memmove(dst, src, n)
        return (OK,)

    def hipMemcpyHtoDAsync(self, d, s, n, stream):
        self._owned(d, n)
        return self._copy("HtoDAsync", d, s, n, stream)

    def hipMemcpyHtoD(self, d, s, n):
        self._owned(d, n)
        return self._copy("HtoD", d, s, n)

    def hipMemcpyDtoH(self, d, s, n):
        self._owned(s, n)
        return self._copy("DtoH", d, s, n)

    def hipMemcpyDtoDAsync(self, d, s, n, stream):
        self._owned(d, n)
        self._owned(s, n)
        return self._copy("DtoDAsync", d, s, n, stream)

    def hipStreamSynchronize(self, stream):
        return (OK,)

    def hipEventCreate(self):
        return OK, object()

    def hipEventRecord(self, ev, stream):
        return (OK,)

    def hipEventElapsedTime(self, a, b):
        return OK, 2.0

    def hipModuleLoadData(self, image):
        assert bytes(image[:4]) == b"\x7fELF"
        return OK, ("module", image)

    def hipModuleGetFunction(self, module, name):
        meta = module[1].kernel_metadata(name.decode())
        return OK, ("function", meta)

    def hipModuleLaunchKernel(self, f, gx, gy, gz, bx, by, bz, lds, stream, kernel_params, extra):
        assert f[0] == "function" and extra is None and stream == "stream0"
        n = len([a for a in f[1][".args"] if not a[".value_kind"].startswith("hidden_")])
        ptrs = [ctypes.c_uint64.from_address(kernel_params + 8 * i).value for i in range(n)]
        vals = [ctypes.c_uint64.from_address(p).value for p in ptrs]
        rec = dict(grid=(gx, gy, gz), block=(bx, by, bz), lds=lds, values=vals,
                   i32=[ctypes.c_int32.from_address(v).value for v in vals])     # what each pointer points at
        (self.capturing if self.capturing is not None else self.launches).append(rec)
        return (OK,)

    def hipStreamBeginCapture(self, stream, mode):
        assert mode == self.hipStreamCaptureMode.hipStreamCaptureModeThreadLocal
        self.capturing = []
        return (OK,)

    def hipStreamEndCapture(self, stream):
        graph, self.capturing = self.capturing, None
        return OK, graph

    def hipGraphInstantiate(self, graph, size):
        self.graphs.append(graph)
        return OK, ("exec", len(self.graphs) - 1), None, ""

    def hipGraphLaunch(self, exec_, stream):
        for rec in self.graphs[exec_[1]]:                   # replay: pointers re-read now
            rec = dict(rec, i32=[ctypes.c_int32.from_address(v).value for v in rec["values"]])
            self.launches.append(dict(rec, graph=True))
        return (OK,)


@pytest.fixture
def fake(monkeypatch, cache_dir):
    rt = FakeHip()
    monkeypatch.setattr(rocm.bindings, "hip", rt)
    monkeypatch.delenv("VEGAFUSE_HIP_GRAPHS", raising=False)
    monkeypatch.delenv("VEGAFUSE_SYNC", raising=False)
    return rt


def test_memory_on_the_stand_in_runtime(fake):
    dev = H.HIPDevice()
    assert dev.online and dev.stream == "stream0" and not dev.graphs
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    d = dev.put(x)
    assert dev.is_device_array(d) and d.shape == (3, 4) and d.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(d), x)
    tree = dev.put({"a": x, "b": [x[0]]})
    np.testing.assert_array_equal(tree["b"][0].numpy(), x[0])
    e = dev.empty((3, 4), "f32")
    np.testing.assert_array_equal(dev.to_host(e), 0)
    dev.copy(e, d)
    np.testing.assert_array_equal(dev.to_host(e), x)
    dev.copy(e.ptr + 4, d.ptr + 8, 4)                          # raw addresses, as decode_greedy does
    assert dev.to_host(e)[0, 1] == 2.0
    dev.copy_in(e, np.ones((3, 4), np.float64))                # converted to the buffer's dtype
    np.testing.assert_array_equal(dev.to_host(e), 1)
    w = np.ones(8, np.float16)
    assert dev.resident(w) is dev.resident(w) and dev.resident(w.copy()) is not dev.resident(w)
    r = dev.random((1000,), "f16", 0.02, 7, 1.0)
    np.testing.assert_array_equal(dev.to_host(r), H.fill_values(0, 1000, 7, 0.02, 1.0).astype(np.float16))
    assert dev.copy_bandwidth(nbytes=1 << 16, reps=2) == pytest.approx(2 * (1 << 16) * 2 / 2e-3 / 1e9)
    ptr = d.ptr
    del d
    assert ptr not in fake.mem                                 # freed with the array


@pytest.mark.parametrize("graphs", [False, True])
def test_launches_and_scalar_slots_on_the_stand_in_runtime(fake, kernels, graphs):
    dev = H.HIPDevice(graphs=graphs)
    cks = dev.compile_many(kernels[1:3])                      # RoPE/KV write and attention: both read pos
    assert all(ck.function[0] == "function" for ck in cks) and cks[0].function is not cks[1].function
    bufs = {}
    for ck in cks:
        for p in ck.kernel.params:
            if p.kind == "buffer" and p.name not in bufs:
                bufs[p.name] = dev.empty(p.shape, p.dtype)
    slots = dev.scalar_slots(["pos", "last"])
    plan = dev.plan([dev.prepare(ck, bufs, slots) for ck in cks], slots)
    assert isinstance(plan, Plan) and plan.graphs == graphs
    for pos in (5, 6, 40):
        slots["pos"] = pos
        plan()
    assert len(fake.launches) == 6 and all(r.get("graph", False) == graphs for r in fake.launches)
    for step, pos in enumerate((5, 6, 40)):
        for ck, rec in zip(cks, fake.launches[2 * step:2 * step + 2]):
            assert (rec["grid"], rec["block"], rec["lds"]) == (ck.hip.grid, ck.hip.block, ck.hip.dynamic_lds)
            for p, v, i32 in zip(ck.kernel.params, rec["values"], rec["i32"]):
                assert v == (slots.ptr(p.name) if p.kind == "scalar" else bufs[p.name].ptr)
                if p.kind == "scalar":
                    assert i32 == pos                              # uploaded before the launch
    assert len(fake.graphs) == (1 if graphs else 0)                # captured once, replayed
    times = dev.time_launches(plan.launches, reps=2)
    assert times == [pytest.approx(1e3)] * 2                       # 2 ms between the events / 2 reps


def test_sync_each_names_the_kernel(fake, kernels, monkeypatch):
    monkeypatch.setenv("VEGAFUSE_SYNC", "1")
    dev = H.HIPDevice(graphs=True)
    assert dev.sync_each and not dev.plan([]).graphs               # no capture when synchronizing each
    ck = dev.compile_many(kernels[2:3])[0]
    bufs = {p.name: dev.empty(p.shape, p.dtype) for p in ck.kernel.params if p.kind == "buffer"}
    launch = dev.prepare(ck, bufs, dev.scalar_slots(["pos"]))
    fake.hipStreamSynchronize = lambda s: (real_hip.hipError_t.hipErrorIllegalAddress,)
    with pytest.raises(H.HipError, match=f"kernel execution failed in kernel {ck.kernel.name}: "
                                         "hipErrorIllegalAddress"):
        launch()


def test_executable_on_the_stand_in_runtime(fake, monkeypatch):
    """dsl.jit(backend="hip") end to end: compile, bind, scalar upload, launches (not run)."""
    dev = H.HIPDevice()
    monkeypatch.setitem(executable._DEVICES, "hip", dev)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((4, 1, 64), (2, 1, 64), (2, 1, 64)))
    kc, vc = np.zeros((2, 32, 64), np.float32), np.zeros((2, 32, 64), np.float32)

    def f(q, k, v, kc, vc, pos):
        out, kc, vc = nn.causal_attention(q, kc, vc, k, v, pos)
        return out, kc, vc
    jf = dsl.jit(f, backend="hip")
    ex = jf.compile(q, k, v, kc, vc, 3)
    assert ex.device is dev and len(ex.kernels) >= 1
    for pos in (3, 9):
        out = jf(q, k, v, kc, vc, pos)
        assert np.asarray(out[0]).shape == (4, 1, 64)
    launched = fake.launches
    assert len(launched) == 2 * len(ex.kernels)
    scal = [(i, j) for i, ck in enumerate(ex.kernels) for j, p in enumerate(ck.kernel.params) if p.kind == "scalar"]
    assert scal                                                  # pos reaches the kernels through device memory
    for step, pos in enumerate((3, 9)):
        for i, j in scal:
            assert launched[step * len(ex.kernels) + i]["i32"][j] == pos


# ----------------------------------------------------------------------------- on an AMD GPU (never run so far)
gpu = pytest.mark.skipif(not HAVE_GPU, reason="no AMD GPU visible to HIP")


def check_on_gpu(f, *args, rtol=2e-3, atol=2e-3):
    jf = dsl.jit(f, backend="hip")
    want = jf.lower(*args).program.run(*dsl.tree_flatten(list(args))[0], compute_dtype="f64")
    got = [np.asarray(g) for g in dsl.tree_flatten(jf(*args))[0]]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.astype(np.float64), w, rtol=rtol, atol=atol)


@gpu
def test_gpu_elementwise_and_gemv():
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((512, 1024)).astype(np.float32), rng.standard_normal(1024).astype(np.float32)
    check_on_gpu(lambda x, y: dsl.tanh(x * y + 1.0) - dsl.sigmoid(y), x, y, rtol=1e-3, atol=1e-3)
    x, g = rng.standard_normal((1, 1536)).astype(np.float32), rng.standard_normal(1536).astype(np.float32)
    w = (rng.standard_normal((8960, 1536)) * 0.05).astype(np.float16)
    check_on_gpu(lambda x, g, w: nn.silu(nn.linear(nn.rms_norm(x, g, 1e-5), w)), x, g, w)


@gpu
def test_gpu_smollm2_greedy_ids_match_the_reference():
    from engine.weights import default_model_path, load_model
    from tests.test_model import PROMPT_IDS, REFERENCE_IDS, greedy
    ids, out, m = greedy(*load_model(default_model_path()), backend="hip")
    assert ids == PROMPT_IDS and out == REFERENCE_IDS
    m.reset()
    m.prefill(ids)
    assert [REFERENCE_IDS[0]] + m.decode_greedy(REFERENCE_IDS[0], 19) == REFERENCE_IDS


def test_compiled_kernels_expose_source_isa_and_resources():
    from tests.decode_step import decode_plan
    dev = H.HIPDevice.offline()
    gemv = [k for k in decode_plan().kernels if k.family == "contract"][0]
    (ck,) = dev.compile_many([gemv])
    assert gemv.name in ck.source and "vf_dot8_h" in ck.source
    assert "global_load_dwordx4" in ck.isa() and "v_dot2_f32_f16" in ck.isa()
    r = ck.resources()
    assert r["scratch_bytes"] == 0 and 1 <= r["waves_per_simd"] <= 9
