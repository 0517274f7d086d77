"""The Loop IR simplifier: each rule on hand-written IR, and the same results before and after
on random index expressions and on every kernel of random small programs (an IR evaluator that,
like C, evaluates only the taken arm of a select and rejects out-of-bounds accesses)."""
from dataclasses import dataclass

import numpy as np
import pytest

import dsl
from codegen import loopir as L
from codegen.simplify import fold_expr, simplify, value_range
from stdlib import nn

I, F = "i32", "f32"


def sym(n, dt=I):
    return L.Sym(n, dt)


def c(v, dt=I):
    return L.Const(v, dt)


def b(op, x, y):
    return L.Bin(op, x, y)


def kernel(body, params):
    return L.Kernel("k", "elementwise", tuple(params), tuple(body))


def buf(name, n, dt=F, role="in"):
    return L.Param(name, dt, "buffer", (n,), role)


# ------------------------------------------------------------------------------ an IR evaluator
def _idiv(a, b):
    q = abs(a) // abs(b)
    return q if (a < 0) == (b < 0) else -q


UN = {"neg": lambda x: -x, "exp": np.exp, "log": np.log, "sqrt": np.sqrt, "rsqrt": lambda x: 1 / np.sqrt(x),
      "sin": np.sin, "cos": np.cos, "tanh": np.tanh, "logistic": lambda x: 1 / (1 + np.exp(-x)),
      "abs": abs, "not": lambda x: not x}
BIN = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
       "div": lambda a, b: a / b, "max": max, "min": min, "lt": lambda a, b: a < b, "le": lambda a, b: a <= b,
       "gt": lambda a, b: a > b, "ge": lambda a, b: a >= b, "eq": lambda a, b: a == b, "ne": lambda a, b: a != b,
       "and": lambda a, b: a and b, "or": lambda a, b: a or b}


def evaluate(e, env, mem):
    if isinstance(e, L.Const):
        return e.value
    if isinstance(e, L.Sym):
        return env[e.name]
    if isinstance(e, L.Load):
        i, a = evaluate(e.index, env, mem), mem[e.buf]
        if not 0 <= i < a.size:
            raise IndexError(f"{e.buf}[{i}] out of bounds ({a.size})")
        v = a.reshape(-1)[i]
        return int(v) if e.dtype == I else bool(v) if e.dtype == "bool" else np.float64(v)
    if isinstance(e, L.Un):
        return UN[e.op](evaluate(e.x, env, mem))
    if isinstance(e, L.Bin):
        x, y = evaluate(e.a, env, mem), evaluate(e.b, env, mem)
        if e.a.dtype == I and e.op in ("idiv", "mod"):
            q = _idiv(x, y)
            return q if e.op == "idiv" else x - q * y
        if e.op == "mod":
            return np.fmod(x, y)
        return BIN[e.op](x, y)
    if isinstance(e, L.Select):
        return evaluate(e.a if evaluate(e.cond, env, mem) else e.b, env, mem)
    if isinstance(e, L.Cast):
        x = evaluate(e.x, env, mem)
        return int(x) if e.dtype == I else bool(x) if e.dtype == "bool" else \
            np.float64(np.float16(x)) if e.dtype == "f16" else np.float64(x)
    raise TypeError(e)


def execute(body, env, mem):
    for s in body:
        if isinstance(s, L.Loop):
            for i in range(evaluate(s.start, env, mem), evaluate(s.stop, env, mem)):
                env[s.var] = i                 # one scope: assignments to outer locals stay
                execute(s.body, env, mem)
        elif isinstance(s, (L.Declare, L.Assign)):
            env[s.name] = evaluate(s.init if isinstance(s, L.Declare) else s.value, env, mem)
        elif isinstance(s, L.Array):
            mem[s.name] = np.zeros(s.size, {F: np.float64, I: np.int64}.get(s.dtype, np.float64))
        elif isinstance(s, L.Store):
            i, a = evaluate(s.index, env, mem), mem[s.buf]
            if not 0 <= i < a.size:
                raise IndexError(f"store {s.buf}[{i}] out of bounds ({a.size})")
            a.reshape(-1)[i] = evaluate(s.value, env, mem)
        elif isinstance(s, L.Reduce):
            for a in s.accs:
                env[a.name] = a.init.value
                if a.arg:
                    env[a.arg] = 0
            for i in range(evaluate(s.start, env, mem), evaluate(s.stop, env, mem)):
                env[s.var] = i
                for a in s.accs:
                    v = evaluate(a.value, env, mem)
                    if a.op == "add":
                        env[a.name] += v
                    elif v > env[a.name]:
                        env[a.name] = v
                        if a.arg:
                            env[a.arg] = i
        elif isinstance(s, L.If):
            execute(s.then if evaluate(s.cond, env, mem) else s.orelse, env, mem)
        elif isinstance(s, L.Attention):
            execute(L.expand_attention(s), env, mem)
        elif not isinstance(s, (L.Comment, L.Barrier)):
            raise TypeError(s)


def run(k, mem, scalars):
    mem = {n: a.copy() for n, a in mem.items()}
    with np.errstate(all="ignore"):
        execute(k.body, dict(scalars), mem)
    return mem


# ------------------------------------------------------------------------------ rules
def test_constants_and_identities_fold():
    x = sym("x")
    assert fold_expr(b("add", x, c(0)), {}) == x
    assert fold_expr(b("sub", x, c(0)), {}) == x
    assert fold_expr(b("mul", c(1), x), {}) == x
    assert fold_expr(b("mul", c(0), x), {}) == c(0)
    assert fold_expr(b("max", c(0), b("min", c(0), c(0))), {}) == c(0)
    assert fold_expr(b("min", c(7), c(3)), {}) == c(3)
    assert fold_expr(b("idiv", c(-7), c(2)), {}) == c(-3) and fold_expr(b("mod", c(-7), c(2)), {}) == c(-1)
    assert fold_expr(b("add", b("add", x, c(3)), c(-3)), {}) == x
    y = sym("y", F)
    assert fold_expr(b("add", y, c(0.0, F)), {}) == b("add", y, c(0.0, F))     # -0.0 + 0.0 is not -0.0


def test_index_rules_use_ranges_from_loop_bounds():
    x, n = sym("x"), sym("n")
    env = {"x": (0, 63), "n": (0, 9)}
    assert fold_expr(b("mod", x, c(64)), env) == x
    assert fold_expr(b("idiv", x, c(64)), env) == c(0)
    assert fold_expr(b("mod", x, c(32)), env) == b("mod", x, c(32))               # x may exceed 31
    assert fold_expr(b("idiv", b("mul", n, c(64)), c(64)), env) == n
    assert fold_expr(b("idiv", b("add", b("mul", n, c(64)), x), c(64)), env) == n
    assert fold_expr(b("mod", b("add", b("mul", n, c(64)), x), c(64)), env) == x
    assert fold_expr(b("add", b("mul", b("idiv", sym("f"), c(8)), c(8)), b("mod", sym("f"), c(8))), {}) == sym("f")
    assert fold_expr(b("idiv", b("add", b("mul", n, c(48)), x), c(16)), env) == b("add", b("mul", n, c(3)), b("idiv", x, c(16)))
    assert fold_expr(b("mod", b("add", b("mul", n, c(48)), x), c(16)), env) == b("mod", x, c(16))
    assert fold_expr(b("mod", b("add", b("mul", n, c(48)), sym("f")), c(16)), env) == \
        b("mod", b("add", b("mul", n, c(48)), sym("f")), c(16))                   # f may be negative
    assert fold_expr(b("mod", b("mod", sym("f"), c(16)), c(8)), {}) == b("mod", sym("f"), c(8))
    clamp = b("max", c(0), b("min", x, c(63)))
    assert fold_expr(clamp, env) == x
    assert fold_expr(clamp, {"x": (0, 64)}) == b("min", x, c(63))                 # only the upper side
    assert fold_expr(clamp, {"x": (-1, 64)}) == clamp
    assert fold_expr(b("lt", x, c(64)), env) == L.Const(True, "bool")
    assert value_range(b("add", b("mul", n, c(64)), x), env) == (0, 9 * 64 + 63)


def test_one_trip_and_zero_trip_loops():
    out = buf("out", 8, role="out")
    body = (L.Loop("i", c(0), c(1), (L.Loop("j", c(0), c(8), (L.Store("out", b("add", b("mul", sym("i"), c(8)),
                                                                                   sym("j")), c(1.0, F)),)),)),
            L.Loop("z", c(4), c(4), (L.Store("out", sym("z"), c(2.0, F)),)))
    k = simplify(kernel(body, [out]))
    assert k.body == (L.Loop("j", c(0), c(8), (L.Store("out", sym("j"), c(1.0, F)),)),)
    par = (L.Loop("i", c(0), c(1), (L.Store("out", sym("i"), c(1.0, F)),), parallel=True),)
    assert simplify(kernel(par, [out])).body == par                   # a parallel loop is the mapping


def test_repeated_loads_and_clamps_are_shared_and_named():
    x, y, out = buf("x", 16), buf("y", 16), buf("out", 16, role="out")
    i = sym("i")
    clamp = b("max", c(0), b("min", b("add", i, sym("p")), c(15)))
    v = L.Load("x", clamp, F)
    body = (L.Loop("i", c(0), c(16), (L.Store("out", i, b("mul", v, v)),
                                      L.Store("out", i, b("add", L.Load("out", i, F), L.Load("y", clamp, F)))),
                   parallel=True),)
    params = [x, y, L.Param("p", I, "scalar"), out]
    k = simplify(kernel(body, params))
    text = L.format_kernel(k)
    assert text.count("x[") == 1 and text.count("y[") == 1 and text.count("min(") == 1, text
    assert "i32 i_clamped = max(0, min(add(i, p), 15))" in text and "f32 x_v = x[i_clamped]" in text, text
    rng = np.random.default_rng()
    mem = {"x": rng.standard_normal(16), "y": rng.standard_normal(16), "out": rng.standard_normal(16)}
    for p in (-20, 3, 40):
        np.testing.assert_array_equal(run(k, mem, {"p": p})["out"], run(kernel(body, params), mem, {"p": p})["out"])


def test_nothing_is_shared_across_a_store_to_the_same_buffer():
    out = buf("out", 4, role="inout")
    ld = L.Load("out", c(0), F)
    body = (L.Store("out", c(1), b("add", ld, c(1.0, F))), L.Store("out", c(0), c(5.0, F)),
            L.Store("out", c(2), b("add", ld, c(1.0, F))))
    k = simplify(kernel(body, [out]))
    assert k.body == body


def test_loads_in_select_arms_stay_conditional():
    x, out = buf("x", 8), buf("out", 8, role="out")
    i = sym("i")
    lo = L.Load("x", b("add", i, c(4)), F)
    hi = L.Load("x", b("sub", i, c(4)), F)
    sel = L.Select(b("lt", i, c(4)), lo, hi)
    body = (L.Loop("i", c(0), c(8), (L.Store("out", i, b("add", sel, sel)),), parallel=True),)
    k = simplify(kernel(body, [x, out]))
    assert not any(isinstance(s, L.Declare) and isinstance(s.init, L.Load) for s in L.walk_stmts(k.body))
    mem = {"x": np.arange(8.0), "out": np.zeros(8)}
    np.testing.assert_array_equal(run(k, mem, {})["out"], run(kernel(body, [x, out]), mem, {})["out"])


def test_loop_invariants_are_hoisted():
    g, x, out = buf("g", 4), buf("x", 64), buf("out", 64, role="out")
    inv = L.Un("rsqrt", b("add", L.Load("g", c(0), F), c(1.0, F)))
    j = sym("j")
    body = (L.Loop("j", c(0), c(64), (L.Store("out", j, b("mul", L.Load("x", j, F), inv)),), parallel=True),)
    k = simplify(kernel(body, [g, x, out]))
    assert isinstance(k.body[0], L.Declare) and k.body[0].init == inv and k.body[0].name == "rsqrt_g"
    assert k.body[1].body == (L.Store("out", j, b("mul", L.Load("x", j, F), sym("rsqrt_g", F))),)
    # not when the loop may not run (the load could be out of bounds), nor from a buffer it writes
    n = L.Param("n", I, "scalar")
    maybe = (L.Loop("j", c(0), sym("n"), body[0].body, parallel=True),)
    assert simplify(kernel(maybe, [g, x, n, out])).body == maybe
    g_out = buf("g", 4, role="inout")
    writes = body + (L.Store("g", c(0), c(1.0, F)),)
    assert simplify(kernel(writes, [g_out, x, out])).body == writes


def test_reduction_loops_keep_their_shape():
    x, out = buf("x", 8), buf("out", 1, role="out")
    k_ = sym("k")
    body = (L.Declare("acc", F, c(0.0, F)),
            L.Loop("k", c(0), c(8), (L.Assign("acc", b("add", sym("acc", F), b("mul", L.Load("x", k_, F),
                                                                                L.Load("x", k_, F)))),)),
            L.Store("out", c(0), sym("acc", F)))
    k = simplify(kernel(body, [x, out]))
    assert k.body == body


@dataclass(frozen=True)
class Guard:                      # statement kinds added later are traversed without changes
    cond: object
    body: tuple


@dataclass(frozen=True)
class Note:
    text: str


def test_unknown_statement_kinds_are_traversed():
    out = buf("out", 8, role="out")
    inner = (L.Store("out", b("add", sym("j"), c(0)), c(1.0, F)),)
    body = (Note("hello"), Guard(b("lt", c(1), c(2)), (L.Loop("j", c(0), c(8), inner),)))
    k = simplify(kernel(body, [out]))
    assert k.body == (Note("hello"), Guard(L.Const(True, "bool"),
                                          (L.Loop("j", c(0), c(8), (L.Store("out", sym("j"), c(1.0, F)),)),)))


# ------------------------------------------------------------------------------ properties
def random_index(rng, names, depth):
    if depth == 0 or rng.random() < 0.25:
        return sym(rng.choice(names)) if rng.random() < 0.7 else c(int(rng.integers(-3, 9)))
    op = rng.choice(["add", "sub", "mul", "idiv", "mod", "min", "max", "clamp", "split", "unscale", "rescale",
                     "modmod", "select"])
    a = random_index(rng, names, depth - 1)
    if op in ("idiv", "mod"):
        return b(op, a, c(int(rng.integers(1, 9))))
    if op == "mul":
        return b(op, a, c(int(rng.integers(-2, 9))))
    if op == "clamp":
        return b("max", c(0), b("min", a, c(int(rng.integers(0, 70)))))
    if op == "split":                          # (a / n) * n + a % n, as unravel and linear_index write it
        n = c(int(rng.integers(1, 9)))
        return b("add", b("mul", b("idiv", a, n), n), b("mod", a, n))
    if op == "unscale":                        # (a * n + b) / n and % n, b sometimes in [0, n)
        n = c(int(rng.integers(1, 9)))
        b_ = random_index(rng, names, depth - 1) if rng.random() < 0.5 else c(int(rng.integers(0, n.value)))
        return b(rng.choice(["idiv", "mod"]), b("add", b("mul", a, n), b_) if rng.random() < 0.7 else b("mul", a, n), n)
    if op == "rescale":                        # (a * m n + b) / n and % n: a reshape's index, split again
        n = int(rng.integers(1, 9))
        b_ = random_index(rng, names, depth - 1)
        return b(rng.choice(["idiv", "mod"]), b("add", b("mul", a, c(n * int(rng.integers(1, 5)))), b_), c(n))
    if op == "modmod":                         # a % (m n) % n
        n = int(rng.integers(1, 9))
        return b("mod", b("mod", a, c(n * int(rng.integers(1, 5)))), c(n))
    if op == "select":
        return L.Select(b("lt", a, random_index(rng, names, depth - 1)), a, random_index(rng, names, depth - 1))
    return b(op, a, random_index(rng, names, depth - 1))


def test_random_index_expressions_keep_their_values():
    seed = int(np.random.default_rng().integers(1 << 30))
    rng = np.random.default_rng(seed)
    out = buf("out", 1, I, "out")
    for trial in range(300):
        ext = {"i": int(rng.integers(1, 5)), "j": int(rng.integers(1, 70)), "k": int(rng.integers(1, 9))}
        e = random_index(rng, list(ext), 4)
        body = (L.Store("out", c(0), e),)
        for v in reversed(list(ext)):
            body = (L.Loop(v, c(0), c(ext[v]), body),)
        k = kernel(body, [out])
        s = simplify(k)
        env_ranges = {v: (0, n - 1) for v, n in ext.items()}
        f = fold_expr(e, env_ranges)
        for _ in range(5):
            env = {v: int(rng.integers(0, n)) for v, n in ext.items()}
            want = evaluate(e, env, {})
            assert evaluate(f, env, {}) == want, (seed, trial, L.format_expr(e), L.format_expr(f), env)
            lo, hi = value_range(e, env_ranges)
            assert lo <= want <= hi, (seed, trial, L.format_expr(e))
        mem = {"out": np.zeros(1, np.int64)}
        assert run(s, mem, {})["out"][0] == run(k, mem, {})["out"][0], (seed, trial, L.format_kernel(s))


def _programs(rng):
    """Small programs in the spirit of the kernel tests, with their random arguments."""
    T, D, N = int(rng.integers(1, 4)), int(rng.choice([8, 16])), int(rng.integers(2, 9))
    x, g, w = rng.standard_normal((T, D), np.float32), rng.standard_normal(D, np.float32), \
        rng.standard_normal((N, D)).astype(np.float16)
    yield (lambda x, g, w: nn.silu(nn.linear(nn.rms_norm(x, g, 1e-5), w)) + 1.0), (x, g, w)
    yield (lambda x: (x + dsl.sum(x, -1, keepdims=True)).T), (x,)
    yield (lambda x: nn.softmax(x * 2.0)), (x,)
    yield (lambda x: dsl.concatenate([-x[:, D // 2:], x[:, :D // 2]], axis=-1) * x), (x,)
    ids = rng.integers(-2, N + 2, size=T).astype(np.int32)
    yield (lambda w, ids: dsl.take(w, ids).astype("f32") * 3.0), (w, ids)
    H, S, hd = 2, 8, 4
    q, kv = rng.standard_normal((H, T, hd), np.float32), rng.standard_normal((1, T, hd), np.float32)
    cache = rng.standard_normal((1, S, hd), np.float32)
    yield (lambda q, kc, vc, k, pos: nn.causal_attention(nn.rope(q, pos, 1e4), kc, vc, nn.rope(k, pos, 1e4), k, pos)), \
        (q, cache, cache.copy(), kv, int(rng.integers(0, S - T + 1)))
    yield (lambda x: (dsl.max(x, axis=-1), dsl.argmax(x, axis=-1), x.reshape(-1)[None])), (x,)


def test_every_kernel_of_random_programs_keeps_its_results():
    from fusion import build_plan                      # the kernels as lowered, before the simplifier
    seed = int(np.random.default_rng().integers(1 << 30))
    rng = np.random.default_rng(seed)
    checked = 0
    for fn, args in _programs(rng):
        low = dsl.jit(fn).lower(*args)
        plan = build_plan(low.program, None, low.in_names, low.donated)
        for k in plan.kernels:
            s = simplify(k)
            mem, scalars = {}, {}
            for p in k.params:
                if p.kind == "scalar":
                    scalars[p.name] = int(rng.integers(0, 4))
                elif p.dtype == I:
                    mem[p.name] = rng.integers(-2, 10, size=p.size).astype(np.int64)
                else:
                    mem[p.name] = rng.standard_normal(p.size)
            before, after = run(k, mem, scalars), run(s, mem, scalars)
            for n in before:
                np.testing.assert_array_equal(after[n], before[n], err_msg=f"seed {seed}: {k.name} {n}")
            checked += 1
    assert checked >= 7


@pytest.mark.parametrize("seed", [0, 1])
def test_programs_run_on_the_cpu_with_the_simplifier(seed):
    rng = np.random.default_rng(seed)
    for fn, args in _programs(rng):
        low = dsl.jit(fn).lower(*args)
        got = dsl.tree_flatten(dsl.jit(fn)(*args))[0]
        want = low.program.run(*args, compute_dtype="f64")
        for a, r in zip(got, want):
            np.testing.assert_allclose(np.asarray(a, np.float64), r, rtol=2e-3, atol=2e-3)


def test_decode_step_has_no_index_noise_and_no_one_trip_loop():
    from codegen.inspect import decode_plan
    from codegen.simplify import exprs_of, subexprs
    plan = decode_plan(context=64)
    for k in plan.kernels:
        for s in L.walk_stmts(k.body):
            for e in (x for y in exprs_of(s) for x in subexprs(y)):
                if isinstance(e, L.Bin) and e.dtype == I:
                    assert not (isinstance(e.a, L.Const) and isinstance(e.b, L.Const)), (k.name, L.format_expr(e))
                    assert not (e.op in ("add", "sub") and L.Const(0, I) in (e.a, e.b)), (k.name, L.format_expr(e))
                    assert not (e.op == "mul" and L.Const(1, I) in (e.a, e.b)), (k.name, L.format_expr(e))
            if isinstance(s, L.Loop) and not s.parallel:
                assert not (isinstance(s.start, L.Const) and isinstance(s.stop, L.Const)
                            and s.stop.value - s.start.value <= 1), (k.name, s.var)


def test_typed_statements_keep_loads_conditional_and_accumulators_in_place():
    g, x, out = buf("g", 4), buf("x", 64), buf("out", 64, role="out")
    j, k = sym("j"), sym("k")
    inv = L.Un("exp", L.Load("g", c(1), F))
    guarded = L.If(b("lt", j, c(8)), (L.Store("out", j, inv),))
    red = L.Reduce("k", c(0), c(8), (L.Acc("s", "add", b("mul", L.Load("x", b("add", b("mul", j, c(8)), k), F),
                                                               L.Load("g", c(2), F))),))
    after = L.Store("out", j, b("add", L.Load("out", j, F), L.Un("sqrt", sym("s", F))))
    body = (L.Loop("j", c(0), c(8), (guarded, red, after), parallel=True),)
    params = [g, x, out]
    k_ = simplify(kernel(body, params))
    hoisted = [s.init for s in k_.body if isinstance(s, L.Declare)]
    assert not any(isinstance(e, L.Load) for h in hoisted for e in _subexprs(h)), hoisted   # no load moved
    assert L.Un("sqrt", sym("s", F)) not in hoisted                    # the accumulator is defined in the loop
    rng = np.random.default_rng()
    mem = {"g": rng.standard_normal(4), "x": rng.standard_normal(64), "out": rng.standard_normal(64)}
    np.testing.assert_array_equal(run(k_, mem, {})["out"], run(kernel(body, params), mem, {})["out"])


def _subexprs(e):
    from codegen.simplify import subexprs
    return list(subexprs(e))


# ------------------------------------------------------------------------------ merged reductions
def _reduces(k):
    out = []

    def walk(body):
        for s in body:
            if isinstance(s, L.Reduce):
                out.append(len(s.accs))
            for blk in (getattr(s, "body", ()), getattr(s, "then", ()), getattr(s, "orelse", ())):
                walk(blk)
    walk(k.body)
    return out


def _plan(f, *args):
    from engine.pipeline import lower_program
    return lower_program(dsl.jit(f).lower(*args))


def test_sibling_reductions_become_one_pass_and_keep_their_values(monkeypatch):
    """sum(x) and sum(x * x), and three masked sums inside a fori_loop body: one Reduce each, all
    accumulators in it, the values of the float64 interpreter; dependent reductions (softmax's sum
    of exp(x - max)) and different ranges stay apart; VEGAFUSE_MERGE_REDUCE=0 keeps all apart."""
    rng = np.random.default_rng()
    x = rng.standard_normal(int(rng.integers(1000, 5000))).astype(np.float32)
    y = rng.standard_normal(777).astype(np.float32)

    def moments(x):
        return dsl.sum(x) + dsl.sum(x * x) + dsl.max(x)

    def search(x):
        def step(_, b):
            w = (b[1] - b[0]) / 4
            n = [dsl.sum(dsl.where(x >= b[0] + i * w, 1.0, 0.0)) for i in (1, 2, 3)]
            return dsl.stack([b[0] + w * sum(dsl.where(c >= 100.0, 1.0, 0.0) for c in n), b[1]])
        return dsl.lax.fori_loop(0, 5, step, dsl.stack([dsl.min(x), dsl.max(x)]))

    def apart(x, y):
        return dsl.sum(dsl.exp(x - dsl.max(x))) + dsl.sum(y)

    assert _reduces(_plan(moments, x).kernels[0]) == [3]
    assert 3 in [n for k in _plan(search, x).kernels for n in _reduces(k)]
    assert sorted(n for k in _plan(apart, x, y).kernels for n in _reduces(k)) == [1, 1, 1]
    for f, args in ((moments, (x,)), (search, (x,)), (apart, (x, y))):
        jf = dsl.jit(f)
        want = jf.lower(*args).program.run(*args, compute_dtype="f64")[0]
        np.testing.assert_allclose(np.asarray(jf(*args), np.float64), want, rtol=1e-5, atol=1e-3)
    monkeypatch.setenv("VEGAFUSE_MERGE_REDUCE", "0")
    assert _reduces(_plan(moments, x).kernels[0]) == [1, 1, 1]
