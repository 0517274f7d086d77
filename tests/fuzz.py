"""Random DSL programs against the float64 reference interpreter.

    python -m tests.fuzz -n 10000 --seed S [--jobs 2] [--backend cpu|cpu+gfx906|emu|emu-persistent|emu-ring]

A program is a list of ops whose parameters are *relative* (fractions in [0, 1)
that pick axes, sizes, operands): they are resolved against the shapes at hand
when the program is written out as Python source.  So any op can be dropped
and any input dim shrunk and the rest still makes a valid program, which is
what shrinking needs.  The source written out is exactly what runs: it is
``exec``'d, traced with ``dsl.jit`` and compiled for the backend.

Each program is classified:

* ok: every output agrees with the float64 interpreter (``compute_dtype="f64"``)
  cast to the dtype the kernel writes, or with the same interpreter run in the
  stored dtypes (f16 rounding of an ill-conditioned chain is not a kernel bug),
  within tolerances that grow with the dtype's epsilon and with the op chain;
* mismatch: some output does not;
* exception: anything raised other than a ``DSLError`` while tracing;
* crash: the process died (programs run in child processes, batch by batch;
  after a crash the rest of the batch is rerun);
* hang: the program ran past ``--time-limit`` seconds (its process is ended
  with the stacks it was in, and the rest of the batch is rerun).

Every failure is shrunk (ops dropped, input dims shrunk, outputs dropped) while
it persists and printed as a runnable script.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import subprocess
import sys
import time

import numpy as np

UNARY = {
    "neg": "-{a}", "abs": "dsl.abs({a})", "tanh": "dsl.tanh({a})", "sigmoid": "dsl.sigmoid({a})",
    "sin": "dsl.sin({a})", "cos": "dsl.cos({a})", "exp": "dsl.exp(dsl.minimum({a}, 3.0))",
    "log": "dsl.log(dsl.abs({a}) + 0.5)", "sqrt": "dsl.sqrt(dsl.abs({a}) + 0.25)",
    "rsqrt": "dsl.rsqrt(dsl.abs({a}) + 0.5)", "np_exp": "np.exp(dsl.tanh({a}))",
    # numpy and jax.nn functions (issue 9)
    "erf": "dsl.erf({a})", "log1p": "dsl.log1p(dsl.abs({a}))", "expm1": "dsl.expm1(dsl.minimum({a}, 3.0))",
    "square": "{a} ** 2", "pow": "(dsl.abs({a}) + 0.5) ** 1.5", "gelu": "dsl.nn.gelu({a})",
    "softplus": "dsl.nn.softplus({a})",
}
ROW_OPS = {     # functions along one axis (issue 9); values only: argsort and indices are not continuous
    "cumsum": "dsl.cumsum({a}, axis={ax}) * 0.1", "sort": "dsl.sort({a}, axis={ax})",
    "log_softmax": "dsl.nn.log_softmax({a}, axis={ax})", "var": "dsl.var({a}, axis={ax})",
    "top_k": "dsl.lax.top_k({a}, {k})[0]",
    # more jax.numpy / jax.nn / jax.lax families along one axis (issue 9's review)
    "softmax": "dsl.nn.softmax({a}, axis={ax})", "logsumexp": "dsl.nn.logsumexp({a}, axis={ax}, keepdims=True)",
    "take_along": "dsl.take_along_axis({a}, dsl.argsort({a}, axis={ax}), axis={ax})",
    "dyn_slice": "dsl.lax.dynamic_slice_in_dim({a}, {k} - 1, 1, axis={ax})",
    "stack": "dsl.stack([{a}, -{a}], axis={ax})", "repeat": "dsl.repeat({a}, 2, axis={ax})",
    "split": "dsl.split(dsl.concatenate([{a}, {a} * 0.5], axis={ax}), 2, axis={ax})[1]",
    "cond": "dsl.lax.cond({a}.sum() > 0, lambda t: t * 2.0, lambda t: t - 1.0, {a})",
    "einsum": "dsl.einsum('...i,...i->...', {a}, {a})", "pad": "dsl.pad({a}, 1, constant_values=0.5)",
}
BINARY = {
    "add": "{a} + {b}", "sub": "{a} - {b}", "mul": "{a} * {b}", "div": "{a} / (dsl.abs({b}) + 0.5)",
    "maximum": "dsl.maximum({a}, {b})", "minimum": "dsl.minimum({a}, {b})", "np_max": "np.maximum({a}, {b})",
}
OPS = (list(UNARY) + list(BINARY) * 2 +
       ["where", "astype", "reduce", "reduce", "argmax", "reshape", "transpose", "slice", "concat",
        "expand", "index", "take", "matmul", "matmul", "dus", "scalar", "qmatmul", "qtake"] + list(ROW_OPS) +
       ["gather", "gather", "at", "at", "selfupdate"]          # indexing: traced indices, .at[], in place
       + ["scan", "fori", "vmap"])             # control flow (tests/fuzz.py's control-flow block)
QUANT = ("q4_0", "q4_1", "q8_0")
WEIGHT_QUANT = QUANT + ("gptq_int4",)   # the formats a contraction's weights take (gptq_int4: a GPTQ checkpoint's)
# a quantized GEMV's activation: at times any floats, which int8 dot products round to q8_1 blocks (each value
# within 2^-16 of its block's largest; a program with such a GEMV is allowed ACT_TOL more), else values q8_1
# holds exactly
ACT_TOL = 2.0 ** -9
# layout: a GEMV through one expert's weights picked by a runtime id (the MoE gather), (N, K) or (K, N)
OPS += ["expert", "expert"]
# attention over a KV cache, f16 (mostly) or f32, written at a runtime position first (issue 10)
OPS += ["attention"]
# a rotate-half epilogue over a contraction (RoPE: the paired_epilogue rule pairs rows j and j + h)
OPS += ["rope", "rope"]
# the matmul family: a fresh activation of several rows, RMS-normalized in the prologue, against f16,
# f32 or quantized weights, scaled by the value at hand in the epilogue
OPS += ["rows_matmul", "rows_matmul"]
# RoPE (rotate-half, interleaved GPT-J pairs, or only the first half of each head rotated) over the
# rows of a contraction, written into an f16 or f32 KV cache at a runtime position, then attended:
# the paired_epilogue rule's KV write, over 1 to 17 rows (the matmul family from 4, the GPU's tiled one at 17)
OPS += ["rope_cache", "rope_cache"]
# an int8 GEMV reading, as they are, the rows another GEMV stores (on GPUs the producer writes their q8_1
# blocks: fusion/q8.py), at times two such chains from one activation (one producer of two q8_1 buffers); the
# rows are integers clipped to +-127 (times 2^-6), which q8_1 holds exactly
OPS += ["qchain"]
# the GPU's tiled matmul (codegen/mma.py, 16 rows or more, K of a chunk or more): rows, K and N at and
# around its rule's and tiles' edges, f16 / f32 / quantized weights, a prologue (none, RMSNorm with a
# gain, LayerNorm, a row's max) and an epilogue (a scale, a bias of f16 or f32, SiLU * a sibling, a
# residual, the value at hand); at times the activation is the value at hand, the weight a wider one's first
# columns (rows not 16 bytes apart)
OPS += ["tiled"] * 12
# a GEMV over a long activation (K 12288 to 40000, RMS-normalized with a gain), f16 or quantized weights: past
# NVIDIA's 48 KiB of static LDS its arrays come from dynamic LDS (codegen.hip.dynamic_arrays), f16 there; past
# gfx906's 64 KiB (K 40000) the activation is a slice a workgroup in device memory (mapping._activation_beyond_lds)
OPS += ["long_gemv"]
# a search in lax.fori_loop whose carry is a stacked [2] bracket, halved, quartered or cut in W parts by a count of
# tests each step, all reductions over a captured value: an f32 threshold over the value at hand, or an i32
# search over ids; or unrolled passes that test W - 1 points at once, one reduction over a [W - 1, n] grid,
# the bracket stored by an optimization_barrier (stdlib/sampling.py's shape)
OPS += ["bisect", "bisect"]
# a residual stream over the value at hand: x = x + f(x) @ w for 2 to 9 layers, f one of tanh, an RMS norm,
# or none; each x is read by the next layer's contraction and its add (fusion.partition's MAX_SHARED_LOADS
# stores it once its expression loads too many buffers, as with the epilogue rule off)
OPS += ["residual"]
# a one-row chain of f16 GEMVs, as a decode layer's MLP: RMS-normalized with a gain, a gate and an up projection
# (SiLU * up: two weight rows a row), the down projection onto the residual, 1 to 3 times; K not always a
# multiple of 64 and N of odd sizes: a persistent kernel's ring phases with partial chunks and blocks of rows of
# unequal numbers of weight rows (codegen/ring.py; --backend emu-ring)
OPS += ["gemv_chain"] * 3
# one decoder layer at one position, as stdlib/llama.py's block writes it: RMSNorm, q, k and v (f16 weights, at
# times with biases), RoPE, the KV write at a runtime position into f16 or f32 caches, grouped-query attention, the
# output projection onto the residual, RMSNorm, SiLU(gate) * up, the down projection; dims, heads and head sizes
# off the real models' (on NVIDIA: a persistent kernel's QKV, attention, O, gate/up and down phases, emu-ring)
OPS += ["decode_layer"] * 2
FLOAT_TOL = {"f16": 4e-3, "f32": 4e-5}


# ----------------------------------------------------------------------------- programs
def random_program(rng):
    """A random program: input specs and ops (op name, operand picks, parameters in [0, 1))."""
    nd = int(rng.integers(1, 4))
    base = [int(rng.choice([1, 2, 3, 4, 5, 7, 8, 16, 33, 64, 73, 88, 95, 128, 300])) for _ in range(nd)]
    while np.prod(base) > 8192:                   # keep programs quick to interpret
        base[int(np.argmax(base))] //= 4
    inputs = []
    for _ in range(int(rng.integers(1, 3))):
        shape = [d if rng.random() < 0.7 else 1 for d in base]
        inputs.append({"shape": shape, "dtype": "f16" if rng.random() < 0.3 else "f32"})
    frac = lambda n: (np.floor(rng.random(n) * 1000) / 1000).tolist()  # noqa: E731  (in [0, 1))
    ops = [{"op": str(rng.choice(OPS)), "pick": frac(3), "p": frac(4)}
           for _ in range(int(rng.integers(2, 14)))]
    return {"inputs": inputs, "ops": ops, "donate": bool(rng.random() < 0.3),
            "fusion": {r: False for r in ("elementwise", "reduce", "prologue", "epilogue", "horizontal",
                                          "paired_epilogue")
                       if rng.random() < 0.07}}


class Writer:
    """Resolves a program's ops against the shapes of traced values, writing one source line each."""

    def __init__(self, prog):
        self.prog, self.lines, self.vals, self.names, self.extra = prog, [], [], [], []
        self.args, self.arg_lines, self.ns = [], [], None
        self.terminal, self.donated = [], None

    # values ---------------------------------------------------------------
    def emit(self, code):
        name = f"v{len(self.lines)}"
        val = eval(code, self.ns)
        self.ns[name] = val
        self.lines.append(f"{name} = {code}")
        return name, val

    def new_input(self, shape, dtype, kind="normal", hi=0, lo=-1):
        name = f"x{len(self.args)}"
        shape = tuple(int(d) for d in shape)
        if kind == "ids":
            make = f"rng.integers({lo}, {hi + 1}, {shape}).astype('i4')"
        elif kind in ("q8small", "q8w"):
            # q8small: integers in [-2, 2] with 127 at each block's first column, times 2^-6 (held exactly by
            # q8_1); q8w: q8_0 weights of integers in [-1, 1] with 127 at each block's second column, times 2^-7
            # (quantized exactly): their products are exact and small
            at, lim, e = (0, 2, 6) if kind == "q8small" else (1, 1, 7)
            cols = f"np.arange({shape[-1]}) % 32 == {at}"
            make = f"(rng.integers({-lim}, {lim + 1}, {shape}) * np.where({cols}, 0, 1) + np.where({cols}, 127, 0)).astype('f4') * 2.0 ** -{e}"
            make = make if kind == "q8small" else f"dsl.QArray.quantize({make}, 'q8_0')"
        elif dtype == "gptq_int4":            # a GPTQ checkpoint by round to nearest, symmetric or not
            make = (f"dsl.QArray.quantize(rng.standard_normal({shape}).astype('f4') * 0.5, 'gptq_int4', "
                    f"sym={bool(len(self.args) % 2)})")
        elif dtype in QUANT:                  # weights quantized by our quantizer
            make = f"dsl.QArray.quantize(rng.standard_normal({shape}).astype('f4') * 0.5, '{dtype}')"
        elif kind == "q8":
            # values that q8_1 holds exactly (each block of 32: integers up to 127 times a power of
            # two, one of them +-127), so the int8 GEMV computes the float product
            make = (f"(rng.integers(-127, 128, {shape}) * np.where(np.arange({shape[-1]}) % 32 == 0, 0, 1) "
                    f"+ np.where(np.arange({shape[-1]}) % 32 == 0, 127, 0)).astype('f4') * 2.0 ** -6")
        elif kind == "int":
            make = f"int(rng.integers({lo}, {hi + 2}))"
        else:
            make = f"(rng.standard_normal({shape}) * 0.7 + 0.1).astype('{ 'f2' if dtype == 'f16' else 'f4' }')"
        self.args.append(name)
        self.arg_lines.append(f"{name} = {make}")
        from dsl.array import Tracer
        from dsl.core import Var
        self.ns[name] = Tracer(Var(() if kind == "int" else shape, dtype))
        return name

    def pick(self, f, pred=lambda v: True):
        cands = [i for i, v in enumerate(self.vals) if v is not None and pred(v[1])]
        # mostly the latest values, so ops chain (f ** 3 favours the end)
        return self.vals[cands[len(cands) - 1 - min(int(f ** 3 * len(cands)), len(cands) - 1)]] if cands else None

    # one op -----------------------------------------------------------------
    def op(self, o):
        import dsl
        name, pk, p = o["op"], o["pick"], o["p"]
        fl = lambda v: v.var.dtype in ("f16", "f32")  # noqa: E731
        a = self.pick(pk[0], fl)
        if a is None:
            return None
        an, av = a
        if name in UNARY:
            return self.emit(UNARY[name].format(a=an))
        if name in BINARY or name == "where":
            b = self.pick(pk[1], lambda v: fl(v) and _broadcastable(v.shape, av.shape))
            bn = b[0] if b is not None and p[0] < 0.8 else repr(round(p[1] * 4 - 2, 2) or 0.5)
            if name == "where":
                c = self.pick(pk[2], lambda v: fl(v) and _broadcastable(v.shape, av.shape))
                cn = c[0] if c is not None else "0.25"
                cmp = ["<", ">", ">=", "<="][int(p[2] * 4)]
                return self.emit(f"dsl.where({an} {cmp} {bn}, {an}, {cn})")
            return self.emit(BINARY[name].format(a=an, b=bn))
        if name == "astype":
            return self.emit(f"{an}.astype('{'f32' if av.var.dtype == 'f16' else 'f16'}')")
        if name == "scalar":
            return self.emit(f"{an} * {round(p[0] * 3 - 1.5, 2) or 0.5} + {round(p[1] - 0.5, 2)}")
        nd = av.ndim
        if name in ("reduce", "argmax"):
            if nd == 0:
                return None
            if name == "argmax":
                ax = int(p[0] * nd)
                i_name, _ = self.emit(f"dsl.argmax({an}, {ax - nd if p[1] < 0.5 else ax})")
                self.terminal.append(i_name)
                return None
            fn = ["sum", "max", "mean"][int(p[0] * 3)]
            axes = [i for i in range(nd) if (p[1] * 2 ** (i + 1)) % 1 < 0.5] or [nd - 1]
            axis = "None" if p[2] < 0.15 else (str(axes[0]) if len(axes) == 1 else str(tuple(axes)))
            keep = p[3] < 0.5
            scale = " * 0.1" if fn == "sum" else ""
            return self.emit(f"dsl.{fn}({an}, axis={axis}{', keepdims=True' if keep else ''}){scale}")
        if name in ROW_OPS:
            if nd == 0:
                return None
            ax = int(p[0] * nd)
            return self.emit(ROW_OPS[name].format(a=an, ax=ax - nd if p[1] < 0.5 else ax,
                                                  k=1 + int(p[2] * min(3, av.shape[-1]))))
        if name == "reshape":
            if nd == 0:
                return self.emit(f"{an}.reshape(1, 1)")
            shape = list(av.shape)
            i = int(p[0] * nd)
            if p[1] < 0.35 and i + 1 < nd:                       # merge two dims
                shape[i:i + 2] = [shape[i] * shape[i + 1]]
            elif p[1] < 0.7:                                     # split a dim
                f = next((f for f in (2, 3, 4, 7, 8, 11) if shape[i] % f == 0 and shape[i] > f), None)
                if f is None:
                    shape.insert(i, 1)
                else:
                    shape[i:i + 1] = [f, shape[i] // f]
            else:
                shape = [d for d in shape if d != 1] if 1 in shape else shape[:i] + [1] + shape[i:]
            return self.emit(f"{an}.reshape({tuple(shape)})")
        if name == "transpose":
            if nd < 2:
                return None
            perm = list(np.argsort([(p[j % 4] * 7.31 * (j + 1)) % 1 for j in range(nd)]))
            return self.emit(f"{an}.transpose({tuple(int(x) for x in perm)})" if p[3] < 0.8 else f"{an}.T")
        if name == "slice":
            if nd == 0:
                return None
            i, n = int(p[0] * nd), av.shape[int(p[0] * nd)]
            lo = int(p[1] * n)
            hi = lo + 1 + int(p[2] * (n - lo - 1))
            idx = ", ".join([":"] * i + [f"{lo}:{hi}"])
            return self.emit(f"{an}[{idx}]")
        if name == "index":
            if nd == 0:
                return None
            i = int(p[0] * av.shape[0])
            return self.emit(f"{an}[{i}]" if p[1] < 0.5 else f"{an}[None, ..., {-1 - int(p[2] * av.shape[-1])}:]")
        if name == "expand":
            return self.emit(f"dsl.expand_dims({an}, {int(p[0] * (nd + 1)) - (nd + 1) * (p[1] < 0.5)})")
        if name == "concat":
            if nd == 0:
                return None
            ax = int(p[0] * nd)
            b = self.pick(pk[1], lambda v: v.ndim == nd and v.dtype == av.dtype and all(
                x == y for k, (x, y) in enumerate(zip(v.shape, av.shape)) if k != ax))
            bn = b[0] if b is not None else an
            return self.emit(f"dsl.concatenate([{an}, {bn}], axis={ax})")
        if name == "take":
            if nd == 0:
                return None
            ids = self.new_input([1 + int(p[0] * 4)] * (1 + (p[1] < 0.3)), "i32", "ids", av.shape[0] - 1)
            return self.emit(f"dsl.take({an}, {ids})")
        if name == "matmul":
            if nd < 1:
                return None
            k = av.shape[-1]
            n = [1, 3, 8, 16, 40][int(p[0] * 5)]
            wd = "f16" if p[1] < 0.4 else "f32"
            if p[2] < 0.5:
                w = self.new_input((n, k), wd)
                return self.emit(f"dsl.dot_t({an}, {w}) * {round(1 / np.sqrt(k), 4)}")
            w = self.new_input((k, n), wd)
            return self.emit(f"({an} @ {w}) * {round(1 / np.sqrt(k), 4)}")
        if name in ("qmatmul", "qtake"):
            formats = QUANT if name == "qtake" else WEIGHT_QUANT
            fmt = formats[int(p[1] * len(formats))]
            k = 32 * (1 + int(p[2] * 3))
            if name == "qtake":
                emb = self.new_input((3 + int(p[0] * 40), k), fmt)
                ids = self.new_input([1 + int(p[3] * 4)], "i32", "ids", 2 + int(p[0] * 40))
                return self.emit(f"dsl.take({emb}, {ids})")
            n = [1, 3, 8, 16, 40][int(p[0] * 5)]
            rows = tuple(av.shape[:-1]) if av.ndim >= 2 and int(np.prod(av.shape[:-1])) <= 8 else (1,)
            xq = self.new_input(rows + (k,), "f32", "q8" if p[3] < 0.5 else "normal")
            w = self.new_input((n, k), fmt)
            return self.emit(f"dsl.dot_t({xq}, {w}) * {round(1 / np.sqrt(k), 4)}")
        if name == "qchain":            # xq @ w1 is exact (small integers times 2^-13), so the clipped rows are too
            k, n = 32 * (1 + int(p[2] * 3)), 32 * (1 + int(p[3] * 3))
            fmt = QUANT[int(p[1] * len(QUANT))]
            xq = self.new_input((1, k), "f32", "q8small")
            w1 = self.new_input((n, k), "q8_0", "q8w")
            w2 = self.new_input(([1, 3, 8, 40][int(p[0] * 4)], n), fmt)
            rows = f"dsl.clip(dsl.dot_t({xq}, {w1}) * 8192.0, -127.0, 127.0) * 0.015625"
            out = f"dsl.dot_t({rows}, {w2}) * {round(1 / np.sqrt(n), 4)}"
            if pk[2] < 0.4:             # a sibling chain from the same activation: one producer kernel, two q8_1 buffers
                n2 = 32 * (1 + int(pk[1] * 3))
                w1b, w2b = self.new_input((n2, k), "q8_0", "q8w"), self.new_input(([1, 3, 8, 40][int(p[0] * 4)], n2), fmt)
                rows2 = f"dsl.clip(dsl.dot_t({xq}, {w1b}) * 8192.0, -127.0, 127.0) * 0.015625"
                out = f"{out} - dsl.dot_t({rows2}, {w2b}) * {round(1 / np.sqrt(n2), 4)}"
            return self.emit(out)
        if name == "rows_matmul":
            T = [4, 5, 17, 40][int(p[0] * 4)]
            fmt = (["f16", "f32"] + list(WEIGHT_QUANT))[int(p[1] * (2 + len(WEIGHT_QUANT)))]
            k = 32 * (1 + int(p[2] * 3)) if fmt in WEIGHT_QUANT else [7, 16, 48][int(p[2] * 3)]
            n = [1, 3, 8, 40][int(p[3] * 4)]
            x = self.new_input((T, k), "f32")
            w = self.new_input((n, k), fmt)
            pro = f"({x} / dsl.sqrt(({x} * {x}).mean(axis=-1, keepdims=True) + 0.5))"
            return self.emit(f"dsl.dot_t({pro}, {w}) * ({round(1 / np.sqrt(k), 4)} * dsl.tanh({an}.mean()))")
        if name == "long_gemv":
            k = [12288, 24576, 27648, 40000][int(p[0] * 4)]
            fmt = (["f16"] + list(WEIGHT_QUANT))[int(p[1] * (1 + len(WEIGHT_QUANT)))]
            x, g = self.new_input((1, k), "f32"), self.new_input((k,), "f32")
            w = self.new_input(([1, 3, 8][int(p[2] * 3)], k), fmt)
            pro = f"({x} / dsl.sqrt(({x} * {x}).mean(axis=-1, keepdims=True) + 0.5) * {g})"
            return self.emit(f"dsl.dot_t({pro}, {w}) * ({round(1 / np.sqrt(k), 4)} * dsl.tanh({an}.mean()))")
        if name == "tiled":
            return self.tiled(av, an, pk, p)
        if name in ("scan", "fori", "vmap"):
            return self.control(name, an, av, pk, p)
        if name == "bisect":
            return self.bisect(an, av, p)
        if name == "decode_layer":
            return self.decode_layer(an, pk, p)
        if name == "gemv_chain":
            k = [64, 136, 200, 512, 1000][int(p[0] * 5)]
            n = [24, 96, 264, 520][int(p[1] * 4)]
            x, _ = self.emit(f"{self.new_input((1, k), 'f32')} + dsl.tanh({an}.astype('f32').mean())")
            for _ in range(1 + int(p[2] * 3)):
                g, w1, w2, wd = (self.new_input(s_, "f16") for s_ in ((k,), (n, k), (n, k), (k, n)))
                h = f"({x} / dsl.sqrt(({x} * {x}).mean(axis=-1, keepdims=True) + 0.5) * {g})"
                m, _ = self.emit(f"dsl.nn.silu(dsl.dot_t({h}, {w1}) * {round(1 / np.sqrt(k), 4)}) * dsl.dot_t({h}, {w2})")
                x, _ = self.emit(f"{x} + dsl.dot_t({m}, {wd}) * {round(0.5 / np.sqrt(n * k), 5)}")
            return x, self.ns[x]
        if name == "residual":
            if nd == 0 or av.shape[-1] > 128:
                return None
            D = av.shape[-1]
            x, _ = self.emit(f"{an}.reshape(-1, {D}).astype('f32')")
            for i in range(2 + int(p[0] * 8)):
                w = self.new_input((D, D), ["f32", "f16"][int(p[1] * 2)])
                act = [f"dsl.tanh({x})", f"({x} / dsl.sqrt(({x} * {x}).mean(axis=-1, keepdims=True) + 0.5))",
                       x][int((p[2] * 7.31 + i * 0.37) % 1 * 3)]
                x, _ = self.emit(f"{x} + dsl.dot_t({act}, {w}) * {round(0.5 / np.sqrt(D), 4)}")
            return self.emit(f"{x}.reshape({tuple(av.shape)})")
        if name == "dus":
            if self.donated is None:
                return None
            dn, dv = self.donated
            u = self.pick(pk[1], lambda v: fl(v) and v.ndim == dv.ndim and all(
                x <= y for x, y in zip(v.shape, dv.shape)))
            if u is None:
                return None
            un, uv = u
            if uv.var.dtype != dv.var.dtype:
                un = f"{un}.astype('{dv.var.dtype}')"
            pos = self.new_input((), "i32", "int", dv.shape[0] - uv.shape[0])
            starts = [pos] + [str(int(p[j % 4] * (dv.shape[j] - uv.shape[j] + 1))) for j in range(1, dv.ndim)]
            name_, val = self.emit(f"dsl.dynamic_update_slice({dn}, {un}, [{', '.join(starts)}])")
            self.donated = (name_, val)
            return None
        if name == "expert":
            return self.expert(av, an, p)
        if name == "attention":
            return self.attention(av, an, p)
        if name == "rope":
            return self.rope(av, an, p)
        if name == "rope_cache":
            return self.rope_cache(an, pk, p)
        if name in ("gather", "at", "selfupdate"):
            return self.indexing(name, a, pk, p)
        raise ValueError(f"unknown op {name}")

    def rope(self, av, an, p):
        """``dot_t(x, w)`` split into heads of 2h rows, each rotated half by half (RoPE's
        ``x * cos + rotate_half(x) * sin``, angles from an iota and at times a runtime position),
        back to the contraction's shape: an epilogue that reads the accumulator at row j +/- h."""
        if av.ndim < 1:
            return None
        k, h, heads = av.shape[-1], [1, 2, 4, 8, 32][int(p[0] * 5)], 1 + int(p[1] * 3)
        n = heads * 2 * h
        w = self.new_input((n, k), "f16" if p[2] < 0.4 else "f32")
        y, _ = self.emit(f"(dsl.dot_t({an}, {w}) * {round(1 / np.sqrt(k), 4)}).reshape({tuple(av.shape[:-1]) + (heads, 2 * h)})")
        pos = self.new_input((), "i32", "int", 50) if p[3] < 0.5 else "3"
        ang, _ = self.emit(f"(dsl.arange({2 * h}) % {h} + {pos}).astype('f32') * {round(0.1 + p[3], 2)}")
        rot = f"dsl.concatenate([-{y}[..., {h}:], {y}[..., :{h}]], axis=-1)"
        return self.emit(f"({y} * dsl.cos({ang}) + {rot} * dsl.sin({ang})).reshape({tuple(av.shape[:-1]) + (n,)})")

    def rope_cache(self, an, pk, p):
        """``k = rope(dot_t(x, w))`` over T rows and H heads of hd, cast to the cache's dtype and
        written at a runtime ``pos`` (0 .. S - T: the cache's end included), then causal attention
        of the rotated k (as queries) over the cache; the new cache is an output too."""
        T, H, hd = [1, 3, 4, 9, 17][int(p[0] * 5)], 1 + int(pk[1] * 3), [2, 4, 8, 16][int(p[1] * 4)]
        fmt = (["f16", "f32"] + list(QUANT))[int(p[2] * (2 + len(QUANT)))]
        k = 32 * (1 + int(pk[2] * 2)) if fmt in QUANT else [5, 16, 48][int(pk[2] * 3)]
        cdt, S, style = "f16" if p[3] < 0.5 else "f32", T + 1 + int(p[3] * 7), int(pk[0] * (3 if hd > 2 else 2))
        x = self.new_input((T, k), "f32")
        w = self.new_input((H * hd, k), fmt)
        cache = self.new_input((H, S, hd), cdt)
        pos = self.new_input((), "i32", "int", S - T - 1, 0)
        y, _ = self.emit(f"(dsl.dot_t({x}, {w}) * {round(1 / np.sqrt(k), 4)}).reshape({T}, {H}, {hd}).transpose(1, 0, 2)")
        if style == 0:                                            # rotate-half, every dim
            r, _ = self.emit(f"nn.rope({y}, {pos}, 100.0)")
        elif style == 1:                                          # GPT-J: pairs (2i, 2i + 1)
            ang, _ = self.emit(f"(dsl.arange({T}) + {pos}).astype('f32')[:, None] * (0.5 ** dsl.arange({hd // 2}, dtype='f32'))")
            pr = f"{y}.reshape({H}, {T}, {hd // 2}, 2)"
            r, _ = self.emit(f"dsl.stack([{pr}[..., 0] * dsl.cos({ang}) - {pr}[..., 1] * dsl.sin({ang}), "
                             f"{pr}[..., 0] * dsl.sin({ang}) + {pr}[..., 1] * dsl.cos({ang})], axis=-1).reshape({H}, {T}, {hd})")
        else:                                                     # partial rotary: the first half of each head
            r, _ = self.emit(f"dsl.concatenate([nn.rope({y}[..., :{hd // 2}], {pos}, 100.0), {y}[..., {hd // 2}:]], axis=-1)")
        c, _ = self.emit(f"dsl.dynamic_update_slice({cache}, {r}.astype('{cdt}'), [0, {pos}, 0])")
        self.terminal.append(c)
        return self.emit(f"dsl.attention({r}, {c}, {c}, {pos}, {round(1 / np.sqrt(hd), 4)})")

    def decode_layer(self, an, pk, p):
        """``block`` of stdlib/llama.py at T = 1 (see ``OPS``): x [1, D] from a new input and the value at hand,
        the caches [Hkv, S, hd] (written at ``pos`` in 0 .. S - 1) outputs too."""
        f = lambda x, m: int((x * m * 7.31) % 1 * m)                # noqa: E731  (another choice from one fraction)
        D, F = [64, 96, 128, 200][int(p[0] * 4)], [96, 136, 264][f(p[0], 3)]
        hkv, group, hd = 1 + int(p[1] * 2), [1, 2, 3][f(p[1], 3)], [16, 32, 64][int(p[2] * 3)]
        hq, S, cdt = hkv * group, 2 + int(p[3] * 40), "f16" if pk[1] < 0.7 else "f32"
        x, _ = self.emit(f"{self.new_input((1, D), 'f32')} + dsl.tanh({an}.astype('f32').reshape(-1).mean())")
        g1, g2 = self.new_input((D,), "f32"), self.new_input((D,), "f32")
        kc, vc = self.new_input((hkv, S, hd), cdt), self.new_input((hkv, S, hd), cdt)
        pos = self.new_input((), "i32", "int", S - 2, 0)

        def linear(h, n, k, heads=None):                         # x @ w.T (+ b) / sqrt(k), as heads [H, 1, hd]
            b = f", {self.new_input((n,), 'f32')}" if pk[2] < 0.5 else ""
            y = f"nn.linear({h}, {self.new_input((n, k), 'f16')}{b}) * {round(1 / np.sqrt(k), 4)}"
            return f"({y}).reshape(1, {heads}, {hd}).transpose(1, 0, 2)" if heads else f"({y})"
        h, _ = self.emit(f"nn.rms_norm({x}, {g1}, 1e-5)")
        q, _ = self.emit(f"nn.rope({linear(h, hq * hd, D, hq)}, {pos}, 1e4)")
        k, _ = self.emit(f"nn.rope({linear(h, hkv * hd, D, hkv)}, {pos}, 1e4)")
        v, _ = self.emit(linear(h, hkv * hd, D, hkv))
        a, _ = self.emit(f"nn.causal_attention({q}, {kc}, {vc}, {k}, {v}, {pos})")
        self.terminal += [self.emit(f"{a}[1]")[0], self.emit(f"{a}[2]")[0]]         # the caches written
        x, _ = self.emit(f"{x} + {linear(f'{a}[0].transpose(1, 0, 2).reshape(1, {hq * hd})', D, hq * hd)}")
        h, _ = self.emit(f"nn.rms_norm({x}, {g2}, 1e-5)")
        m, _ = self.emit(f"nn.silu({linear(h, F, D)}) * {linear(h, F, D)}")
        return self.emit(f"{x} + {linear(m, D, F)}")

    def tiled(self, av, an, pk, p):
        """``epilogue(dot_t(prologue(x), w))`` of T rows (15 to 100: the tiled matmul's rule takes 16 or
        more), K and N at and around its chunk (32) and tile (64) edges; see ``OPS``."""
        fmt = (["f16", "f16", "f32"] + list(WEIGHT_QUANT))[int(p[1] * (3 + len(WEIGHT_QUANT)))]
        f = lambda x, m: int((x * m * 7.31) % 1 * m)                # noqa: E731  (another choice from one fraction)
        if av.ndim == 2 and av.shape[0] >= 15 and av.shape[1] >= 32 and fmt not in WEIGHT_QUANT and pk[1] < 0.5:
            x, (T, k) = an, av.shape
        else:
            T = [15, 16, 17, 33, 64, 65, 100][int(p[0] * 7)]
            k = 32 * (1 + int(p[2] * 4)) if fmt in WEIGHT_QUANT else [32, 33, 40, 64, 96, 130][int(p[2] * 6)]
            x = self.new_input((T, k), "f16" if pk[2] < 0.25 else "f32")
        n = [1, 7, 8, 24, 65, 72][int(p[3] * 6)]
        extra = 0 if fmt in WEIGHT_QUANT else [0, 0, 4, 12][f(p[1], 4)]     # at times the first k columns of a wider weight
        w = self.new_input((n, k + extra), fmt)
        w = f"{w}[:, :{k}]" if extra else w
        pro = [x, f"({x} / dsl.sqrt(({x} * {x}).mean(axis=-1, keepdims=True) + 0.5) * {self.new_input((k,), 'f32')})",
               f"(({x} - {x}.mean(axis=-1, keepdims=True)) / dsl.sqrt(dsl.var({x}, axis=-1, keepdims=True) + 0.5))",
               f"({x} / (dsl.max(dsl.abs({x}), axis=-1, keepdims=True) + 0.5))"][f(p[0], 4)]
        y = f"(dsl.dot_t({pro}, {w}) * {round(1 / np.sqrt(k), 4)})"
        epi = f(p[3], 5)
        if epi == 1:
            return self.emit(f"{y} + {self.new_input((n,), 'f16' if pk[2] < 0.5 else 'f32')}")
        if epi == 2:
            up = self.new_input((n, k), fmt)
            return self.emit(f"dsl.nn.silu({y}) * (dsl.dot_t({pro}, {up}) * {round(1 / np.sqrt(k), 4)})")
        if epi == 3:
            return self.emit(f"{self.new_input((T, n), 'f32')} + {y}")
        if epi == 4:
            return self.emit(f"{y} * dsl.tanh({an}.mean().astype('f32'))")
        return self.emit(f"{y} * {round(p[2] + 0.5, 2)}")

    def expert(self, av, an, p):
        """``x @ take(w, e).T`` or ``x @ take(w, e)``: expert ``e`` (a runtime i32, at times out
        of range: clamped) of stacked weights [E, n, k] or [E, k, n]; quantized ones [E, n, k]."""
        n_exp, n = 2 + int(p[0] * 6), [1, 3, 8, 16, 40][int(p[1] * 5)]
        e = self.new_input((), "i32", "int", n_exp - 1)
        if p[2] < 0.25:
            fmt = QUANT[int(p[3] * len(QUANT))]
            k = 32 * (1 + int(p[2] * 12))
            rows = tuple(av.shape[:-1]) if av.ndim >= 2 and int(np.prod(av.shape[:-1])) <= 8 else (1,)
            xq = self.new_input(rows + (k,), "f32", "q8")
            w = self.new_input((n_exp, n, k), fmt)
            return self.emit(f"dsl.dot_t({xq}, dsl.take({w}, {e})) * {round(1 / np.sqrt(k), 4)}")
        if av.ndim < 1:
            return None
        k, wd = av.shape[-1], "f16" if p[3] < 0.5 else "f32"
        if p[2] < 0.6:
            w = self.new_input((n_exp, n, k), wd)
            return self.emit(f"dsl.dot_t({an}, dsl.take({w}, {e})) * {round(1 / np.sqrt(k), 4)}")
        w = self.new_input((n_exp, k, n), wd)
        return self.emit(f"({an} @ dsl.take({w}, {e})) * {round(1 / np.sqrt(k), 4)}")

    def attention(self, av, an, p):
        """k, v [Hkv, T, d] written at a runtime position (at times out of range: clamped) into
        caches [Hkv, S, d] of f16 (mostly) or f32, then ``dsl.attention`` of q [Hkv * G, T, d], a new
        input scaled by a value of the program (so the op chains)."""
        hkv, group = 1 + int(p[0] * 3), [1, 2, 3, 7][int(p[1] * 4)]
        T, d = [1, 1, 2, 5, 17][int(p[2] * 5)], [8, 16, 64][int(p[3] * 3)]
        S, kv = T + 1 + int((p[0] * 7.3 % 1) * 60), "f16" if p[1] * 5.7 % 1 < 0.7 else "f32"
        q = self.new_input((hkv * group, T, d), "f32")
        k, v = self.new_input((hkv, T, d), "f32"), self.new_input((hkv, T, d), "f32")
        kc, vc = self.new_input((hkv, S, d), kv), self.new_input((hkv, S, d), kv)
        pos = self.new_input((), "i32", "int", S - T)
        kc, _ = self.emit(f"dsl.dynamic_update_slice({kc}, {k}.astype('{kv}'), [0, {pos}, 0])")
        vc, _ = self.emit(f"dsl.dynamic_update_slice({vc}, {v}.astype('{kv}'), [0, {pos}, 0])")
        scale = f"(1.0 + 0.1 * dsl.tanh(dsl.mean({an}).astype('f32')))"
        return self.emit(f"dsl.attention({q} * {scale}, {kc}, {vc}, {pos}, {round(1 / np.sqrt(d), 4)})")

    def indexing(self, name, a, pk, p):
        """x[ids] / x[:, i] / take(axis=) with traced ids (negative and out-of-range ones too),
        x.at[ids].op(v) on a value or on the donated buffer, and an elementwise update of the
        donated buffer (written in place when nothing later reads its old value)."""
        fl = lambda v: v.var.dtype in ("f16", "f32")  # noqa: E731
        an, av = a
        if name == "selfupdate":
            if self.donated is None:
                return None
            dn, dv = self.donated
            u = self.pick(pk[1], lambda v: fl(v) and _broadcastable(v.shape, dv.shape))
            un = u[0] if u is not None else "0.25"
            un = un if u is None or u[1].dtype == dv.dtype else f"{un}.astype('{dv.dtype}')"
            self.donated = self.emit(f"{dn} * {round(p[0] * 1.6 - 0.8, 2) or 0.5} + {un}")
            return None
        donated = name == "at" and self.donated is not None and p[0] < 0.6
        tn, tv = self.donated if donated else a
        if tv.ndim == 0:
            return None
        ax = int(p[1] * tv.ndim)
        n = tv.shape[ax]
        lead = ":, " * ax
        if name == "gather":
            if p[2] < 0.3:                                   # a traced scalar index
                i = self.new_input((), "i32", "int", n, lo=-n - 1)
                return self.emit(f"{tn}[{lead}{i}]")
            if p[2] > 0.9:                                   # per-row indices along the axis
                shape = [1 + int(p[3] * 4) if d == ax else s for d, s in enumerate(tv.shape)]
                ids = self.new_input(shape, "i32", "ids", n, lo=-n - 1)
                return self.emit(f"dsl.take_along_axis({tn}, {ids}, {ax}, mode='clip')")
            ids = self.new_input([1 + int(p[3] * 4)] * (1 + (p[2] > 0.85)), "i32", "ids", n, lo=-n - 1)
            return self.emit(f"{tn}[{lead}{ids}]" if p[2] < 0.6 else f"dsl.take({tn}, {ids}, axis={ax})")
        k = 1 + int(p[3] * 3)
        ids = self.new_input([k], "i32", "ids", n, lo=-n - 1)
        shape = tv.shape[:ax] + (k,) + tv.shape[ax + 1:]
        v = self.pick(pk[1], lambda v: fl(v) and _broadcastable(v.shape, shape))
        vn = v[0] if v is not None and p[2] < 0.8 else repr(round(p[2] * 4 - 2, 2) or 0.5)
        op = ["set", "add", "mul", "min", "max"][int(p[2] * 5)]
        res = self.emit(f"{tn}.at[{lead}{ids}].{op}({vn})")
        if donated:
            self.donated = res
            return None
        return res

    # ---- control flow: random loop bodies and vmapped functions
    def _small_body(self, x, p, shape):
        """A random elementwise expression of ``x`` (a name, of ``shape``): a unary op of a binary
        op with a value of the program that broadcasts to it (captured by the body) or a constant."""
        u = list(UNARY)[int(p[0] * len(UNARY))]
        b = list(BINARY)[int(p[1] * len(BINARY))]
        other = self.pick(p[2], lambda v: v.var.dtype in ("f16", "f32") and _broadcastable(v.shape, shape)
                          and v.ndim <= len(shape))
        on = other[0] if other is not None and p[3] < 0.6 else repr(round(p[3] - 0.5, 2) or 0.5)
        return UNARY[u].format(a=BINARY[b].format(a=x, b=on))

    def control(self, name, an, av, pk, p):
        """``lax.scan`` (carry and stacked ys), ``lax.fori_loop`` (the index picks rows with take)
        and ``dsl.vmap``; carries stay bounded (tanh), bodies may hold a GEMV with a new weight."""
        nd = av.ndim
        if nd == 0:
            return None
        row = tuple(av.shape[1:])
        if name == "vmap":
            ax = -1 if p[0] < 0.3 and nd > 1 else 0
            rshape = tuple(av.shape[:-1]) if ax == -1 else row
            expr = self._small_body("r", [p[1], p[2], pk[1], p[3]], rshape)
            if rshape and p[3] < 0.3:
                expr = f"dsl.sum({expr}, axis=-1)"
            elif rshape and p[3] < 0.55:
                w = self.new_input(([1, 3, 8, 16][int(p[0] * 4)], rshape[-1]), "f32")
                expr = f"dsl.dot_t({expr}, {w}) * {round(1 / np.sqrt(rshape[-1]), 4)}"
            out_ax = ", out_axes=-1" if p[2] < 0.3 and rshape else ""
            return self.emit(f"dsl.vmap(lambda r: {expr}, in_axes={ax}{out_ax})({an})")
        upd = self._small_body("c", [p[1], p[2], pk[1], p[3]], row)
        if row and p[0] < 0.35:
            w = self.new_input((row[-1], row[-1]), "f32")
            upd = f"dsl.dot_t({upd}, {w}) * {round(1 / np.sqrt(row[-1]), 4)}"
        if name == "fori":
            n = av.shape[0]
            lo = int(p[2] * n) if n > 1 else 0
            return self.emit(f"dsl.lax.fori_loop({lo}, {n}, lambda i, c: dsl.tanh(({upd}) * 0.5 + "
                             f"dsl.take({an}, i) * 0.5).astype('{av.var.dtype}'), {an}[0] * 0.5)")
        y = ["c", "r * c", "dsl.sum(c * r) * 0.1" if row else "c * r"][int(p[0] * 3)]
        tn, _ = self.emit(f"dsl.lax.scan(lambda c, r: (dsl.tanh(({upd}) * 0.5 + r * 0.5).astype('{av.var.dtype}'), {y}), "
                           f"{an}[0], {an}{', reverse=True' if pk[2] < 0.3 else ''})")
        cn, _ = self.emit(f"{tn}[0]")
        self.terminal.append(cn)
        return self.emit(f"{tn}[1]")

    def bisect(self, an, av, p):
        """A search whose carry is a stacked [2] bracket, each step reductions over a captured value,
        as ``stdlib/sampling.py`` runs it: halving (one test a step), quartering (three tests at
        the quarter points, sibling reductions over one row, and nested wheres) or cutting in W = 4
        or 16 parts (W - 1 tests whose i32 count c picks points c and c + 1); or, as the sampler
        runs now, unrolled passes cutting in W = 16 or 64 parts, the W - 1 tests one reduction over a
        [W - 1, n] grid and the bracket stored by ``optimization_barrier`` after each pass.  f32: the largest
        t where the count, or an integer weight, of {x >= t} reaches a target (the k-th largest x,
        a weighted quantile) over the value at hand, which yields x - t.  i32: the largest id
        whose prefix sum of integer weights stays within a target, over a fresh row of 1 to 4097
        ids, which adds the weight of the id after it.  Weights are integers and targets lie
        halfway between multiples of 1/16, so each test is exact in f32 and in float64 alike."""
        if av.ndim == 0:
            return None
        frac = round((1 + int(p[2] * 15)) / 16, 4)
        weights = lambda shape: self.emit(f"dsl.floor(dsl.abs({self.new_input(shape, 'f32')}) * 4.0) + 1.0")[0]  # noqa: E731
        quarter, counted, grid = 0.4 <= p[3] < 0.8, p[3] >= 0.8, p[3] >= 0.9
        ways = (64 if int(p[2] * 96) % 3 == 2 else 16) if grid or int(p[2] * 32) % 2 else 4
        if p[0] < 0.6:
            x = an if av.var.dtype == "f32" else f"{an}.astype('f32')"
            if p[1] < 0.5:
                w, target = "1", str(1 + int(p[2] * int(np.prod(av.shape))))
            else:
                w = weights(av.shape)
                target = f"(dsl.sum({w}) * {frac} + 0.03125)"
            holds = f"dsl.sum(dsl.where({x} >= {{s}}, {w}, 0)) >= {target}"
            grid_holds = (f"dsl.sum(dsl.where({x}.reshape(-1) >= {{s}}, {w if w == '1' else w + '.reshape(-1)'}, 0), "
                          f"axis=1) >= {target}")
            points = ("[b[0] + (b[1] - b[0]) * q for q in (0.25, 0.5, 0.75)]" if quarter
                      else "[(b[0] + b[1]) * 0.5]")
            steps = [8, 10, 12, 15][int(p[3] * 4) % 2 * 2 + int(p[1] * 2)] if quarter else [16, 20, 24, 30][int(p[3] * 4)]
            if counted:
                steps = [8, 10, 12, 15][int(p[1] * 4)] // {4: 1, 16: 2, 64: 3}[ways]
            point = lambda q: f"(b[0] + (b[1] - b[0]) * ({q}).astype('f32') * {1 / ways})"  # noqa: E731
            init = f"dsl.stack([dsl.min({x}), dsl.max({x}) + 1.0])"
        else:
            n = [1, 2, 3, 7, 64, 255, 300, 1000, 4097][int(p[1] * 9)]
            w = weights((n,))
            ids, _ = self.emit(f"dsl.iota(({n},), dtype='i32')")
            holds = f"dsl.sum(dsl.where({ids} <= {{s}}, {w}, 0.0)) <= dsl.sum({w}) * {frac} + 0.03125"
            grid_holds = holds.replace(", 0.0)) <=", ", 0.0), axis=1) <=")
            points = "[b[0] + (b[1] - b[0]) * q // 4 for q in (1, 2, 3)]" if quarter else "[(b[0] + b[1]) // 2]"
            steps = (-(-(n.bit_length()) // 2) if quarter else n.bit_length()) + int(p[3] * 3)
            if counted:
                steps, left = int(p[1] * 2), n
                while left > 1:
                    left, steps = -(-left // ways), steps + 1
            point = lambda q: f"(b[0] + (b[1] - b[0]) * ({q}) // {ways})"  # noqa: E731
            init = f"dsl.stack([dsl.full((), -1, 'i32'), dsl.full((), {n - 1}, 'i32')])"
        if grid:                # unrolled passes, each one reduction over a [ways - 1, n] grid: points x values
            inner, _ = self.emit(f"dsl.iota(({ways - 1}, 1), dtype='i32') + 1")
            bn, _ = self.emit(init)
            for _ in range(max(steps, 1)):      # a one-id row still runs a pass: the grid is the family's point
                test = grid_holds.format(s=point(inner))
                c, _ = self.emit(f"(lambda b: dsl.sum(dsl.where({test}, 1, 0)))({bn})")
                bn, _ = self.emit(f"(lambda b: dsl.lax.optimization_barrier(dsl.stack([{point(c)}, {point(c + ' + 1')}])))({bn})")
        elif counted:
            test = holds.format(s=point("dsl.full((), q, 'i32')"))
            tests = f"sum(dsl.where({test}, 1, 0) for q in range(1, {ways}))"
            body = f"((c := {tests}), dsl.stack([{point('c')}, {point('c + 1')}]))[-1]"
        elif quarter:
            body = (f"((t := {points}), (h := [{holds.format(s='s')} for s in t]), dsl.stack(["
                    "dsl.where(h[2], t[2], dsl.where(h[1], t[1], dsl.where(h[0], t[0], b[0]))), "
                    "dsl.where(h[0], dsl.where(h[1], dsl.where(h[2], b[1], t[2]), t[1]), t[0])]))[-1]")
        else:
            mid = points[1:-1]
            body = f"dsl.where({holds.format(s=mid)}, dsl.stack([{mid}, b[1]]), dsl.stack([b[0], {mid}]))"
        if not grid:
            bn, _ = self.emit(f"dsl.lax.fori_loop(0, {steps}, lambda i, b: {body}, {init})")
        if p[0] < 0.6:
            return self.emit(f"({x} - {bn}[0]).astype('{av.var.dtype}')")
        hi, _ = self.emit(f"{bn}[1]")
        self.terminal.append(hi)
        return self.emit(f"{an} + dsl.take({w}, {hi}).astype('{av.var.dtype}') * 0.125")

    def write(self, outputs=None):
        """Trace the program (resolving every op); returns the source of ``f`` and its inputs."""
        import dsl
        from dsl.core import _TRACES, Trace
        from stdlib import nn
        self.ns = {"dsl": dsl, "np": np, "nn": nn}
        trace = Trace()
        _TRACES.append(trace)
        try:
            for spec in self.prog["inputs"]:
                n = self.new_input(spec["shape"], spec["dtype"])
                self.vals.append((n, self.ns[n]))
            if self.prog["donate"]:
                self.donated = self.vals[0]
            for o in self.prog["ops"]:
                self.vals.append(self.op(o))
        finally:
            _TRACES.pop()
        live = [v for v in self.vals if v is not None]
        outs = [live[-1][0]] + self.terminal + [v[0] for v in live[len(self.prog["inputs"]):-1][-3:-2]]
        if self.donated is not None and self.donated[0] != self.vals[0][0]:
            outs.append(self.donated[0])
        outs = list(dict.fromkeys(outs))
        if outputs is not None:
            outs = [o for i, o in enumerate(outs) if i in outputs] or outs[:1]
        body = _dead_code_free(self.lines, outs)
        donate = self.prog["donate"] and self.donated is not None and self.donated[0] in outs
        return {"args": self.args, "arg_lines": self.arg_lines, "body": body, "outs": outs,
                "donate": donate, "fusion": self.prog["fusion"]}


def _broadcastable(a, b):
    """Does ``a`` broadcast to ``b`` (the result keeps ``b``'s shape)?"""
    return len(a) <= len(b) and all(x in (1, y) for x, y in zip(a[::-1], b[::-1]))


def _dead_code_free(lines, outs):
    need, keep = set(outs), []
    for line in reversed(lines):
        name, code = line.split(" = ", 1)
        if name in need:
            keep.append(line)
            need |= {t for t in _names(code)}
    return keep[::-1]


def _names(code):
    import re
    return set(re.findall(r"\b[vx]\d+\b", code))


def source(w, seed):
    """A runnable script reproducing the program ``w`` (a ``Writer.write()`` result)."""
    used = set(w["outs"]) | {n for line in w["body"] for n in _names(line)}
    args = [a for a in w["args"] if a in used] or w["args"][:1]
    lines = ["import numpy as np", "import dsl", "from stdlib import nn", "", "", f"def f({', '.join(args)}):"]
    lines += [f"    {line}" for line in w["body"]]
    lines.append(f"    return {', '.join(w['outs'])}{',' if len(w['outs']) == 1 else ''}")
    lines += ["", "", f"rng = np.random.default_rng({seed})"]
    lines += [line for line in w["arg_lines"] if line.split(" = ")[0] in args]
    opts = []
    if w["donate"]:
        opts.append("donate_argnums=(0,)")
    if w["fusion"]:
        opts.append(f"fusion={w['fusion']!r}")
    lines.append(f"args = [{', '.join(args)}]")
    lines.append(f"jf = dsl.jit(f{', ' if opts else ''}{', '.join(opts)})")
    lines.append("want = jf.lower(*args).program.run(*args, compute_dtype='f64')")
    lines.append("got = jf(*[np.copy(a) if isinstance(a, np.ndarray) else a for a in args])")
    lines.append("for g, r in zip(got, want):")
    lines.append("    print(np.max(np.abs(np.asarray(g, np.float64) - r)), g.dtype, g.shape)")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- running one program
SWITCHED = {   # backends that are the emulated GPU path with switches set
    "emu-persistent": {"VEGAFUSE_PERSISTENT": "1", "VEGAFUSE_PERSISTENT_RING": "0"},
    "emu-ring": {"VEGAFUSE_PERSISTENT": "1", "VEGAFUSE_PERSISTENT_RING": "1"},
}


BACKENDS = ("cpu", "cpu+gfx906", "emu", "emu-persistent", "emu-ring", "cuda", "hip")


def for_backend(src, backend):
    """``src`` (a script of ``source``, which runs on the CPU) set to run as the fuzzer ran it on
    ``backend``: its device and its switches (``SWITCHED``), every kernel also compiled for gfx906
    after ``+gfx906``.  It imports ``tests``: run it from the repository's root."""
    base = backend.removesuffix("+gfx906")
    if base != backend:
        src += ("from tests.fuzz import _compile_gfx906  # noqa: E402  (every kernel for gfx906, through hiprtc)\n"
                "_compile_gfx906(jf.compile(*args).plan.kernels)\n")
    if base == "cpu":
        return src
    device = repr(base)
    if base.startswith("emu"):
        src = "".join(f"os.environ[{k!r}] = {v!r}\n" for k, v in SWITCHED.get(base, {}).items()) + \
            "from tests.emu_device import emu_backend  # noqa: E402\n" + src
        src, device = "import os\n" + src, "emu_backend()"
    return src.replace("jf = dsl.jit(f", f"jf = dsl.jit(f, backend={device}", 1)


def run_source(src, backend="cpu"):
    """Run a script written by ``source``; returns (status, detail).  ``backend`` "emu-persistent":
    the emulated GPU path with ``VEGAFUSE_PERSISTENT=1`` (runs of kernels as one persistent kernel) and
    ``VEGAFUSE_PERSISTENT_RING=0``; "emu-ring": the same with its GEMV phases fed by the ring."""
    if backend not in SWITCHED:
        return _run_source(src, backend)
    before = {k: os.environ.get(k) for k in SWITCHED[backend]}
    os.environ.update(SWITCHED[backend])
    try:
        return _run_source(src, "emu")
    finally:
        for k, v in before.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


def _run_source(src, backend):
    import dsl
    from dsl.core import DSLError
    ns = {}
    head, _, _ = src.partition("jf = dsl.jit(")
    try:
        exec(head, ns)
        opts = src.split("jf = dsl.jit(f", 1)[1].split("\n", 1)[0][:-1]
        gfx906 = backend.endswith("+gfx906")               # also compile every kernel for gfx906
        backend = backend.removesuffix("+gfx906")
        if backend == "emu":                               # the sm_90 kernel text on the CPU (tests/emu_device.py)
            from tests.emu_device import emu_backend
            backend = emu_backend()
        jf = eval(f"dsl.jit(ns_f{opts}, backend={backend!r})", {"dsl": dsl, "ns_f": ns["f"]})
        args = ns["args"]
        low = jf.lower(*args)
    except DSLError as e:
        return "invalid", str(e)
    except Exception as e:                                   # noqa: BLE001
        return "exception", f"{type(e).__name__} while tracing: {e}"
    try:
        want = low.program.run(*args, compute_dtype="f64")
        native = _run_native(low.program, args)
        got = jf(*[np.copy(a) if isinstance(a, np.ndarray) else a for a in args])
        got = dsl.tree_flatten(got)[0]
    except DSLError as e:
        return "exception", f"DSLError after tracing: {e}"
    except Exception as e:                                   # noqa: BLE001
        return "exception", f"{type(e).__name__}: {str(e)[:300]}"
    if gfx906:
        try:
            _compile_gfx906(jf.compile(*args).plan.kernels)
        except Exception as e:                               # noqa: BLE001
            return "exception", f"gfx906: {type(e).__name__}: {str(e)[:300]}"
    if native is None:
        return "ok", "ill-conditioned (non-finite in stored dtypes)"
    covered = _persistent_coverage(jf.compile(*args).plan.kernels) if backend != "cpu" else ""
    native, peak = native
    nops = len(low.program.eqns)
    prims = {e.prim.name for e in low.program.eqns}
    act = ACT_TOL if {"dequantize", "dot"} <= prims else 0.0     # an int8 GEMV's activation in q8_1 blocks
    values = list(low.program.inputs) + [e.out for e in low.program.eqns]
    low_precision = "f16" if any(v.dtype == "f16" for v in values) else "f32"
    producer = {e.out: e for e in low.program.eqns}
    for i, (g, w, n, v) in enumerate(zip(got, want, native, low.program.outputs)):
        e = producer.get(v)
        if e is not None and e.prim.name == "argmax":          # ties: any index of a maximal value
            bad = _argmax_ties(low.program, e, args, np.asarray(g), FLOAT_TOL[low_precision] * (2 + nops) + act, peak)
            if bad:
                return "mismatch", f"output {i} (argmax {list(v.shape)}): {bad}"
            continue
        bad = _compare(np.asarray(g), w, n, v.dtype if v.dtype not in FLOAT_TOL else low_precision, nops, peak, act)
        if bad:
            ties = _ties_flipped(low.program, args, FLOAT_TOL[low_precision] * (2 + nops) + act, peak)
            if ties and not any(_compare(np.asarray(g), t, t, o.dtype if o.dtype not in FLOAT_TOL else low_precision,
                                         nops, peak, act) for g, t, o in zip(got, ties, low.program.outputs)):
                return "ok", "ill-conditioned (a comparison on its tie decided the other way)"
            return "mismatch", f"output {i} ({v.dtype}{list(v.shape)}): {bad}"
    return "ok", covered


def _persistent_coverage(kernels) -> str:
    """What of a GPU plan's ``kernels`` ran as a persistent kernel: "persistent kernel: N phases, M fed
    by the ring", or "" (run_many counts these)."""
    from codegen import loopir as L
    phases = [s for k in kernels if k.family == "persistent" for s in k.body if isinstance(s, L.Phase)]
    return f"persistent kernel: {len(phases)} phases, {sum(bool(s.tiled) for s in phases)} fed by the ring" if phases else ""


COMPARISONS = ("gt", "ge", "lt", "le", "eq", "ne")


def _ties_flipped(prog, args, eps, peak):
    """The float64 run of ``prog`` with every float comparison whose operands sit within rounding of
    each other (``eps`` of their size, plus of the program's largest value ``peak``) decided the other
    way, or None when no comparison sits on its tie.  A predicate on its tie (``lax.cond(x.sum() > 0)``
    on a sum that is exactly 0) may go either way in a kernel's rounding, and what follows from it (a
    branch, a selected value) with it: a kernel that agrees with this run is right."""
    from dsl.core import Lit, Program
    env, flipped = dict(zip(prog.inputs, args)), False
    for e in prog.eqns:
        ins = list(dict.fromkeys(a for a in e.inputs if not isinstance(a, Lit)))
        out = Program(ins, [e], [e.out]).run(*[env[a] for a in ins], compute_dtype="f64")[0]
        if e.prim.name in COMPARISONS and all(a.dtype in FLOAT_TOL for a in e.inputs):
            x, y = (np.asarray(a.value, np.float64) if isinstance(a, Lit) else env[a] for a in e.inputs)
            tie = np.abs(x - y) <= eps * (np.abs(x) + np.abs(y) + 0.1 * peak)
            flipped = flipped or bool(np.any(tie))
            out = out ^ tie
        env[e.out] = out
    return [np.asarray(o.value) if isinstance(o, Lit) else env[o] for o in prog.outputs] if flipped else None


def _compile_gfx906(kernels):
    """Render and compile ``kernels`` for gfx906 through hiprtc (no GPU needed): a program that
    runs on the CPU but whose HIP does not compile is a bug."""
    from codegen.inspect import compiler_for
    from codegen.targets import get_target
    from engine.build import build, render
    from codegen.inspect import gpu_plan
    from fusion.schedule import Plan
    compiler = compiler_for(get_target("gfx906"))
    kernels = gpu_plan(Plan(list(kernels), {}, [], [], []), get_target("gfx906")).kernels       # as a GPU runs them (fusion/q8.py)
    build(render(kernels, compiler), compiler)


def _run_native(prog, args):
    """The interpreter in the stored dtypes; None when some value is not finite or beyond f16 range."""
    from dsl.core import NP_DTYPES, Lit
    env = {v: a if v.dtype in WEIGHT_QUANT else np.asarray(a).astype(NP_DTYPES[v.dtype]) for v, a in zip(prog.inputs, args)}
    peak = 1.0
    read = lambda a: np.asarray(a.value, NP_DTYPES[a.dtype]) if isinstance(a, Lit) else env[a]  # noqa: E731
    with np.errstate(all="ignore"):
        for e in prog.eqns:
            out = np.asarray(e.prim.impl(*[read(a) for a in e.inputs], **e.params)).astype(NP_DTYPES[e.out.dtype])
            if out.dtype.kind == "f" and not (np.all(np.isfinite(out)) and np.all(np.abs(out) < 3e4)):
                return None
            env[e.out] = out
            if out.dtype.kind == "f" and out.size:
                peak = max(peak, float(np.max(np.abs(out))))
    return [read(o) for o in prog.outputs], peak


def _argmax_ties(prog, e, args, g, eps, peak):
    """'' when every index in ``g`` picks a value within tolerance of its row's maximum."""
    from dsl.core import Program
    x = Program(prog.inputs, prog.eqns, [e.inputs[0]]).run(*args, compute_dtype="f64")[0]
    if g.shape != x.shape[:-1] or np.any(g < 0) or np.any(g >= x.shape[-1]):
        return f"indices {g.ravel()[:8].tolist()} out of range for {list(x.shape)}"
    picked = np.take_along_axis(x, g[..., None].astype(np.int64), -1)[..., 0]
    best = np.max(x, -1)
    worse = picked < best - eps * (np.abs(best) + 0.1 * peak)
    if np.any(worse):
        return f"{int(np.sum(worse))} of {g.size} rows pick a value below the maximum"
    return ""


def _compare(g, want, native, dtype, nops, peak, act=0.0):
    """'' when ``g`` agrees with the f64 reference or the stored-dtype run, else what differs.

    The tolerance is relative, plus an absolute part that scales with the largest value the
    program computes (``peak``: rounding there reaches the output); both grow with the op count, and
    ``act`` is added where int8 dot products rounded an activation (``ACT_TOL``)."""
    if dtype in ("i32", "bool"):
        if np.array_equal(g, want.astype(g.dtype)) or np.array_equal(g, native):
            return ""
        return f"{int(np.sum(g != want))} of {g.size} differ"
    eps = FLOAT_TOL[dtype] * (2 + nops) + act
    g = g.astype(np.float64)
    scale = max(float(np.max(np.abs(want))) if want.size else 0.0, peak, 1.0)
    for ref in (want.astype(np.float64), native.astype(np.float64)):
        err = np.abs(g - ref)
        if np.all(err <= eps * (np.abs(ref) + 0.1 * scale)) and np.array_equal(np.isnan(g), np.isnan(ref)):
            return ""
    err = np.abs(g - want)
    i = np.unravel_index(np.nanargmax(np.where(np.isnan(err), np.inf, err)), g.shape) if g.ndim else ()
    return f"max error {float(np.nanmax(err)):.3g} at {list(i)}: got {g[i]!r}, want {float(want[i])!r}"


def program_source(seed, index, prog=None, outputs=None):
    rng = np.random.default_rng([seed, index])
    prog = prog or random_program(rng)
    return source(Writer(prog).write(outputs), seed * 100003 + index), prog


# ----------------------------------------------------------------------------- shrinking
def shrink(prog, status, check, seed, index, budget=150):
    """Drop ops and outputs, shrink input dims, while ``check(src) == status``."""
    best = prog
    best_src = program_source(seed, index, best)[0]

    def attempt(cand, outputs=None):
        nonlocal best, best_src, budget
        if budget <= 0:
            return False
        budget -= 1
        try:
            src = program_source(seed, index, cand, outputs)[0]
        except Exception:                                    # noqa: BLE001
            return False
        if src != best_src and check(src) == status:
            best, best_src = cand, src
            return True
        return False

    progress = True
    while progress and budget > 0:
        progress = False
        for i in range(len(best["ops"]) - 1, -1, -1):
            if i < len(best["ops"]):
                progress |= attempt({**best, "ops": best["ops"][:i] + best["ops"][i + 1:]})
        for k in range(len(best["inputs"])):
            for j, d in enumerate(best["inputs"][k]["shape"]):
                for nd in sorted({1, d // 2, d - 1} - {d, 0}):
                    ins = [dict(x, shape=list(x["shape"])) for x in best["inputs"]]
                    ins[k]["shape"][j] = nd
                    if attempt({**best, "inputs": ins}):
                        progress = True
                        break
        if best["fusion"]:
            progress |= attempt({**best, "fusion": {}})
        if best["donate"]:
            progress |= attempt({**best, "donate": False})
    for o in range(4):                                       # a single output, if that still fails
        if attempt(best, [o]):
            return best_src
    return best_src


# ----------------------------------------------------------------------------- processes
TIME_LIMIT = 120.0          # seconds one program may run (the slowest take a few)
EMU_TIME_LIMIT = 600.0      # on the emulated GPU, a fiber per GPU thread and its workgroups in turn: a cumsum of
                            # 600 rows (25600 block-wide sums, each a dozen barriers of 256 threads) takes 5 s


def time_limit_of(backend: str, given: float | None = None) -> float:
    """Seconds a program may run on ``backend`` before it counts as a hang (``given``, else the default)."""
    return given if given is not None else EMU_TIME_LIMIT if backend.startswith("emu") else TIME_LIMIT


def worker(seed, indices, backend, shrink_failures, time_limit=TIME_LIMIT):
    """Child process: run programs, one JSON line per program (``start`` first, so a crash is known).
    A program still running after ``time_limit`` seconds ends the process, its stacks on stderr
    (``faulthandler``: this works inside native code too); the parent records it as a hang."""
    from dsl.core import DSLError
    abort_at = os.environ.get("VEGAFUSE_FUZZ_ABORT_AT")         # tests the crash isolation
    hang_at = os.environ.get("VEGAFUSE_FUZZ_HANG_AT")           # tests the time limit
    for i in indices:
        print(json.dumps({"start": i}), flush=True)
        if abort_at is not None and int(abort_at) == i:
            os.abort()
        try:                      # writing the program traces it: DSL errors show up here first
            src, prog = program_source(seed, i)
        except DSLError as e:
            print(json.dumps({"index": i, "status": "invalid", "detail": str(e)}), flush=True)
            continue
        except Exception as e:                               # noqa: BLE001
            rec = {"index": i, "status": "exception", "detail": f"while tracing: {type(e).__name__}: {e}",
                   "repro": f"# program {i} of seed {seed}: python -c 'import tests.fuzz as F; "
                            f"print(F.program_source({seed}, {i}))'"}
            print(json.dumps(rec), flush=True)
            continue
        faulthandler.dump_traceback_later(time_limit, exit=True)
        if hang_at is not None and int(hang_at) == i:
            time.sleep(10 * time_limit)
        status, detail = run_source(src, backend)
        faulthandler.cancel_dump_traceback_later()
        rec = {"index": i, "status": status, "detail": detail}
        if status in ("mismatch", "exception") and shrink_failures:
            rec["repro"] = shrink(prog, status, lambda s: run_source(s, backend)[0], seed, i)
        elif status in ("mismatch", "exception"):
            rec["repro"] = src
        print(json.dumps(rec), flush=True)


def _child(seed, indices, backend, shrink_failures, time_limit):
    cmd = [sys.executable, "-m", "tests.fuzz", "--worker", "--seed", str(seed), "--backend", backend,
           "--time-limit", str(time_limit),
           "--indices", ",".join(map(str, indices))] + ([] if shrink_failures else ["--no-shrink"])
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def shrink_crash(seed, index, backend, budget=40):
    """Shrink a crashing program, each candidate in its own process."""
    def check(src):
        p = subprocess.run([sys.executable, "-c", "import sys, tests.fuzz as F; print(F.run_source(sys.stdin.read(), "
                            f"{backend!r})[0])"], input=src, capture_output=True, text=True,
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        return "crash" if p.returncode < 0 or p.returncode not in (0, 1) else "ran"
    src, prog = program_source(seed, index)
    return shrink(prog, "crash", check, seed, index, budget)


def _hang_detail(err, limit):
    """One line for a program ended by the time limit: the innermost frame of its main thread."""
    frames = [x.strip() for x in err.split("most recent call first):")[-1].splitlines() if x.strip().startswith("File")]
    return f"still running after {limit:g} s" + (f", in {frames[0]}" if frames else "")


STATUSES = ("ok", "invalid", "mismatch", "exception", "crash", "hang")


def run_many(n, seed, jobs=2, backend="cpu", batch=50, shrink_failures=True, progress=True, start=0,
             time_limit=None):
    """Run programs ``start .. start+n-1`` of ``seed``; returns ({status: count}, failures, seconds); on a
    persistent backend the counts also hold "persistent" and "ring", the ok programs that made a persistent
    kernel and those with GEMV phases fed by the ring.
    A program that runs longer than ``time_limit`` seconds (default ``time_limit_of(backend)``) is a
    failure of status "hang"."""
    t0 = time.time()
    time_limit = time_limit_of(backend, time_limit)
    pending = [list(range(b, min(b + batch, start + n))) for b in range(start, start + n, batch)]
    counts = dict.fromkeys(STATUSES, 0)
    if backend in SWITCHED:                         # of the ok: what they covered
        counts.update(persistent=0, ring=0)
    failures, running, done = [], [], 0
    while pending or running:
        while pending and len(running) < jobs:
            idx = pending.pop(0)
            running.append((_child(seed, idx, backend, shrink_failures, time_limit), idx))
        proc, idx = running.pop(0)
        out, err = proc.communicate()
        seen, current = set(), None
        for line in out.splitlines():
            if not line.startswith("{"):
                continue
            rec = json.loads(line)
            if "start" in rec:
                current = rec["start"]
                continue
            seen.add(rec["index"])
            counts[rec["status"]] += 1
            if rec["status"] == "ok" and rec["detail"].startswith("persistent kernel"):
                counts["persistent"] += 1
                counts["ring"] += not rec["detail"].endswith(" 0 fed by the ring")
            if rec["status"] in ("mismatch", "exception"):
                failures.append(rec)
        rest = [i for i in idx if i not in seen]
        if rest:
            if current is not None and current in rest and "Timeout (" in err:
                counts["hang"] += 1     # not shrunk: each try could take the whole limit
                failures.append({"index": current, "status": "hang", "detail": _hang_detail(err, time_limit)[:300],
                                 "repro": program_source(seed, current)[0]})
                rest.remove(current)
            elif current is not None and current in rest:
                counts["crash"] += 1
                tail = err.strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
                rec = {"index": current, "status": "crash", "detail": tail[0][:300]}
                if shrink_failures:
                    rec["repro"] = shrink_crash(seed, current, backend)
                else:
                    rec["repro"] = program_source(seed, current)[0]
                failures.append(rec)
                rest.remove(current)
            if rest:
                pending.insert(0, rest)
        done = sum(counts[k] for k in STATUSES)
        if progress:                        # one updating line on a terminal, a line per batch in a log
            tty = sys.stderr.isatty()
            print(f"{chr(13) if tty else ''}{done}/{n} programs: {_summary(counts)}  ({time.time() - t0:.0f} s)",
                  end="" if tty else "\n", file=sys.stderr, flush=True)
    if progress and sys.stderr.isatty():
        print(file=sys.stderr)
    return counts, failures, time.time() - t0


def _summary(c):
    covered = (f" ({c['persistent']} of them a persistent kernel, {c['ring']} with GEMV phases fed by the ring)"
               if "persistent" in c else "")
    return (f"ok {c['ok'] + c['invalid']}{covered}, mismatches {c['mismatch']}, exceptions {c['exception']}, "
            f"crashes {c['crash']}, hangs {c['hang']}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=1000, help="programs to run")
    ap.add_argument("--seed", type=int, default=None, help="seed (default: a fresh one, printed)")
    ap.add_argument("--start", type=int, default=0, help="index of the first program")
    ap.add_argument("--jobs", type=int, default=2, help="child processes")
    ap.add_argument("--backend", default="cpu", help="backend the programs run on (default cpu; cpu+gfx906: "
                    "also compile every kernel for gfx906 through hiprtc; emu: the GPU path, each kernel's "
                    "sm_90 text run on the CPU by tests/emu_device.py; emu-persistent: the same with "
                    "VEGAFUSE_PERSISTENT=1 VEGAFUSE_PERSISTENT_RING=0; emu-ring: with the ring, =1)")
    ap.add_argument("--batch", type=int, default=50, help="programs per child process")
    ap.add_argument("--no-shrink", action="store_true", help="print failures as generated")
    ap.add_argument("--time-limit", type=float, default=None,
                    help=f"seconds a program may run before it counts as a hang (default {TIME_LIMIT:g}, "
                         f"{EMU_TIME_LIMIT:g} on the emulated GPU)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--indices", default="", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.backend not in BACKENDS:
        ap.error(f"--backend {a.backend}: choose one of {', '.join(BACKENDS)}")
    if a.backend in ("cuda", "hip") and not a.worker:
        from engine.devices.probe import BackendUnavailable, check_backend
        try:
            check_backend(a.backend)
        except BackendUnavailable as e:
            ap.error(str(e))
    seed = a.seed if a.seed is not None else int(np.random.SeedSequence().entropy % 2 ** 31)
    if a.worker:
        worker(seed, [int(i) for i in a.indices.split(",") if i], a.backend, not a.no_shrink,
               time_limit_of(a.backend, a.time_limit))
        return 0
    print(f"seed {seed}, {a.n} programs, backend {a.backend}, {a.jobs} job{'' if a.jobs == 1 else 's'}", file=sys.stderr)
    counts, failures, secs = run_many(a.n, seed, a.jobs, a.backend, a.batch, not a.no_shrink, start=a.start,
                                      time_limit=a.time_limit)
    print(f"{a.n} programs: {_summary(counts)} ({secs:.0f} s)")
    print(f"({counts['invalid']} of the ok were invalid programs rejected with a DSLError)")
    for f in sorted(failures, key=lambda r: r["index"]):
        print(f"\n# --- program {f['index']} (seed {seed}): {f['status']}: {f['detail']}")
        print(for_backend(f["repro"], a.backend) if f.get("repro") else "")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
