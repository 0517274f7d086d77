"""AMDGPU code objects: the ELF that hiprtc produces, read without a GPU.

Usage::

    co = CodeObject(elf_bytes, "gemv", source, arch="gfx906")   # what engine.devices.rocm.compile_hip returns
    co.kernel_symbols()    # ['gemv']
    co.resources()         # {'vgprs': 19, 'sgprs': 14, 'lds_bytes': 0, 'scratch_bytes': 0, 'waves_per_simd': 10, ...}
    print(co.isa())        # disassembly (llvm-objdump)

The kernel metadata is the msgpack note of code-object v3+ (``NT_AMDGPU_METADATA``), decoded
by the small :func:`msgpack_loads`; waves per SIMD come from the target table's occupancy model
(:func:`codegen.targets.occupancy`).  :meth:`CodeObject.isa` needs an ``llvm-objdump`` that
knows AMDGPU (:func:`find_llvm_tool`).
"""
from __future__ import annotations

import os
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

from .targets import get_target, occupancy

NT_AMDGPU_METADATA = 32          # note type of the code-object v3+ metadata (owner "AMDGPU"), msgpack


def _elf_sections(data: bytes) -> dict:
    """name -> (type, offset, size, link, entsize) of a little-endian ELF64 file."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a little-endian ELF64 file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    raw = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strtab = raw[shstrndx][4]

    def cstr(off):
        return data[off:data.index(b"\0", off)].decode()
    return {cstr(strtab + s[0]): (s[1], s[4], s[5], raw[s[6]][4] if s[6] < shnum else 0, s[9]) for s in raw}


def _elf_notes(data: bytes, sections: dict):
    """(owner, type, descriptor bytes) of every note in SHT_NOTE sections (4-byte aligned)."""
    for typ, off, size, _, _ in sections.values():
        if typ != 7:                                           # SHT_NOTE
            continue
        p, end = off, off + size
        while p + 12 <= end:
            namesz, descsz, ntype = struct.unpack_from("<III", data, p)
            p += 12
            owner = data[p:p + namesz].rstrip(b"\0").decode()
            p += -(-namesz // 4) * 4
            yield owner, ntype, data[p:p + descsz]
            p += -(-descsz // 4) * 4


def _elf_symbols(data: bytes, sections: dict) -> dict:
    """name -> (value, size, type) from .symtab (or .dynsym)."""
    sec = sections.get(".symtab") or sections.get(".dynsym")
    if sec is None:
        return {}
    _, off, size, stroff, entsize = sec
    out = {}
    for p in range(off, off + size, entsize or 24):
        st_name, info, _, _, value, sz = struct.unpack_from("<IBBHQQ", data, p)
        if st_name:
            name = data[stroff + st_name:data.index(b"\0", stroff + st_name)].decode()
            out[name] = (value, sz, info & 0xF)
    return out


def msgpack_loads(buf: bytes):
    """Decode one msgpack value (the subset AMDGPU metadata uses: nil, bools, ints, floats,
    str, bin, arrays, maps).  Spec: https://github.com/msgpack/msgpack/blob/master/spec.md"""
    pos = 0

    def take(n):
        nonlocal pos
        pos += n
        return buf[pos - n:pos]

    def unpack(fmt):
        return struct.unpack(fmt, take(struct.calcsize(fmt)))[0]

    def value():
        b = take(1)[0]
        if b <= 0x7F:
            return b
        if b >= 0xE0:
            return b - 0x100
        if 0x80 <= b <= 0x8F:
            return {value(): value() for _ in range(b & 0x0F)}
        if 0x90 <= b <= 0x9F:
            return [value() for _ in range(b & 0x0F)]
        if 0xA0 <= b <= 0xBF:
            return take(b & 0x1F).decode()
        simple = {0xC0: None, 0xC2: False, 0xC3: True}
        if b in simple:
            return simple[b]
        fixed = {0xCA: ">f", 0xCB: ">d", 0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q",
                 0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q"}
        if b in fixed:
            return unpack(fixed[b])
        sized = {0xC4: ">B", 0xC5: ">H", 0xC6: ">I", 0xD9: ">B", 0xDA: ">H", 0xDB: ">I",
                 0xDC: ">H", 0xDD: ">I", 0xDE: ">H", 0xDF: ">I"}
        if b in sized:
            n = unpack(sized[b])
            if b <= 0xC6:
                return bytes(take(n))
            if b <= 0xDB:
                return take(n).decode()
            if b <= 0xDD:
                return [value() for _ in range(n)]
            return {value(): value() for _ in range(n)}
        raise ValueError(f"msgpack: unsupported type byte 0x{b:02x} at offset {pos - 1}")
    return value()

# ----------------------------------------------------------------------------- tools
def find_llvm_tool(name: str) -> str:
    """Path of an LLVM tool (e.g. ``llvm-objdump``) that knows AMDGPU.

    Looks in ``$VEGAFUSE_LLVM_BIN``, the ROCm install's ``llvm/bin`` (ROCm >= 5.3), then
    ``PATH`` for ``name-20`` ... ``name-14`` (Debian's ROCm 5.2 uses ``llvm-objdump-15``),
    then plain ``name`` if its ``--version`` lists the amdgcn target.  Raises
    ``engine.devices.rocm.HipUnavailable`` (with what to install) when none is found.
    """
    from engine.devices.rocm import HipUnavailable, find_hiprtc
    dirs = [os.environ.get("VEGAFUSE_LLVM_BIN", "")]
    try:
        dirs.append(str(Path(find_hiprtc().install_root) / "llvm" / "bin"))
    except HipUnavailable:
        pass
    dirs += ["/opt/rocm/llvm/bin"]
    for d in dirs:
        if d and os.access(Path(d) / name, os.X_OK):
            return str(Path(d) / name)
    for v in range(20, 13, -1):
        p = shutil.which(f"{name}-{v}")
        if p:
            return p
    p = shutil.which(name)
    if p:
        out = subprocess.run([p, "--version"], capture_output=True, text=True).stdout
        if "amdgcn" in out:
            return p
    raise HipUnavailable(f"no {name} with the AMDGPU target found (looked in $VEGAFUSE_LLVM_BIN, "
                         f"<rocm>/llvm/bin, PATH for {name}-N and {name}): on Debian/Ubuntu "
                         f"`apt-get install llvm-15` (comes with hipcc), or ROCm >= 5.3")


# ----------------------------------------------------------------------------- code objects
class CodeObject(bytes):
    """An AMDGPU code object (ELF), as hiprtc makes it: the ELF bytes themselves (what
    ``hipModuleLoadData`` takes; ``.code`` is a plain ``bytes`` copy) plus

    ``name``: the kernel this object is for; ``source``: the HIP source; ``arch``, ``options``:
    how it was compiled; ``cache_hit``: found in the disk cache; ``compile_seconds``: hiprtc wall
    time (0 on a hit); ``target``: the target table whose occupancy model :meth:`resources`
    applies (default: the table named ``arch``).
    """

    def __new__(cls, code: bytes, name: str, source: str, arch="gfx906", options=(),
                cache_hit=False, compile_seconds=0.0, target=None):
        self = super().__new__(cls, code)
        self.name, self.source, self.arch, self.options = name, source, arch, tuple(options)
        self.cache_hit, self.compile_seconds = cache_hit, compile_seconds
        self.target = target
        self._meta = None
        return self

    @property
    def code(self) -> bytes:
        return bytes(self)

    def metadata(self) -> dict:
        """The decoded AMDGPU metadata note (``amdhsa.kernels``, ``amdhsa.target``, ...)."""
        if self._meta is None:
            data = bytes(self)
            secs = _elf_sections(data)
            for owner, ntype, desc in _elf_notes(data, secs):
                if owner == "AMDGPU" and ntype == NT_AMDGPU_METADATA:
                    self._meta = msgpack_loads(desc)
                    break
            else:
                raise ValueError("code object has no AMDGPU metadata note (code object v3+ expected)")
            self._symbols = _elf_symbols(data, secs)
        return self._meta

    def kernel_symbols(self) -> list[str]:
        """Names of the kernels in this code object, in metadata order."""
        return [k[".name"] for k in self.metadata()["amdhsa.kernels"]]

    def kernel_metadata(self, kernel: str | None = None) -> dict:
        """The metadata map of ``kernel`` (default: ``self.name``, or the only kernel)."""
        kernels = self.metadata()["amdhsa.kernels"]
        want = kernel or self.name
        for k in kernels:
            if k[".name"] == want:
                return k
        if kernel is None and len(kernels) == 1:
            return kernels[0]
        raise KeyError(f"no kernel {want!r} in code object (has {self.kernel_symbols()})")

    def resources(self, kernel: str | None = None, workgroup_size: int | None = None,
                  dynamic_lds_bytes: int = 0) -> dict:
        """Register, memory and occupancy figures of one kernel, from the code object metadata.

        Keys: ``vgprs`` (per lane), ``sgprs`` (per wave, incl. VCC etc.), ``vgpr_spills``,
        ``sgpr_spills``, ``lds_bytes`` (static LDS per workgroup), ``scratch_bytes`` (private
        memory per lane; non-zero means spills or stack arrays), ``wavefront_size``,
        ``max_workgroup_size`` (``__launch_bounds__``; 1024 if none), ``kernarg_bytes``,
        ``code_bytes`` (size of the kernel's machine code: its symbol size in ``.text``), and the
        occupancy of :func:`codegen.targets.occupancy` (``waves_per_simd``, ``waves_per_cu``,
        ``workgroups_per_cu``, ``limiter``) for ``workgroup_size`` threads (default
        ``max_workgroup_size``) and ``lds_bytes + dynamic_lds_bytes`` of LDS.
        """
        k = self.kernel_metadata(kernel)
        sym = self._symbols.get(k[".name"]) or self._symbols.get(k[".symbol"].removesuffix(".kd"))
        r = {
            "vgprs": k[".vgpr_count"], "sgprs": k[".sgpr_count"],
            "vgpr_spills": k.get(".vgpr_spill_count", 0), "sgpr_spills": k.get(".sgpr_spill_count", 0),
            "lds_bytes": k[".group_segment_fixed_size"], "scratch_bytes": k[".private_segment_fixed_size"],
            "wavefront_size": k[".wavefront_size"], "max_workgroup_size": k[".max_flat_workgroup_size"],
            "kernarg_bytes": k[".kernarg_segment_size"], "code_bytes": sym[1] if sym else None,
        }
        r.update(occupancy(self.target or get_target(self.arch), r["vgprs"], r["sgprs"],
                           r["lds_bytes"] + dynamic_lds_bytes, workgroup_size or r["max_workgroup_size"]))
        return r

    def isa(self, kernel: str | None = None) -> str:
        """Disassembly (``llvm-objdump -d --mcpu=<arch>``); of ``kernel`` only if given."""
        tool = find_llvm_tool("llvm-objdump")
        with tempfile.NamedTemporaryFile(suffix=".co") as f:
            f.write(self)
            f.flush()
            cmd = [tool, "-d", f"--mcpu={self.arch}", f.name]
            if kernel:
                cmd.insert(2, f"--disassemble-symbols={kernel}")
            p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed: {p.stderr.strip()}")
        return p.stdout.replace(f.name, f"{self.name}.co")

    def __repr__(self):
        return f"<CodeObject {self.name} {self.arch} {len(self)} bytes>"


def pack_kernargs(kernel_meta: dict, args) -> bytes:
    """The kernel-argument buffer for ``args`` laid out as the metadata's ``.args`` say.

    Pointers (``global_buffer``): anything with a ``.ptr`` (a :class:`DeviceArray`) or an int
    address, 8 bytes.  By-value arguments: a Python int (signed/unsigned to the arg's size), a
    float (4 bytes: f32, 8: f64) or a numpy scalar of exactly the arg's size.  Hidden arguments
    (``hidden_*``) are not packed: the runtime supplies them.
    """
    explicit = [a for a in kernel_meta[".args"] if not a[".value_kind"].startswith("hidden_")]
    if len(explicit) != len(args):
        raise ValueError(f"kernel {kernel_meta['.name']}: {len(explicit)} arguments expected, got {len(args)}")
    size = max((a[".offset"] + a[".size"] for a in explicit), default=0)
    buf = bytearray(-(-size // 8) * 8)
    for a, v in zip(explicit, args):
        off, n = a[".offset"], a[".size"]
        if hasattr(v, "ptr"):
            v = v.ptr
        if hasattr(v, "dtype") and hasattr(v, "tobytes"):      # numpy scalar / 0-d array
            raw = v.tobytes()
        elif isinstance(v, float):
            raw = struct.pack({4: "<f", 8: "<d"}[n], v)
        elif isinstance(v, int):
            raw = v.to_bytes(n, "little", signed=v < 0)
        else:
            raise TypeError(f"kernel argument {a.get('.name', off)}: cannot pass {type(v).__name__}")
        if len(raw) != n:
            raise ValueError(f"kernel argument at offset {off}: {len(raw)} bytes given, {n} expected")
        buf[off:off + n] = raw
    return bytes(buf)


