"""Indexing as in numpy and JAX: x[ids], x[i, :, j], take, take_along_axis, one_hot, x.at[...],
lax.dynamic_slice / dynamic_update_slice, and in-place updates of donated buffers.

Every result is checked against numpy directly and against the float64 reference interpreter;
fresh random inputs each run.  Out-of-range indices: gathers clamp, updates drop (as JAX)."""
import re

import numpy as np
import pytest

import dsl
from dsl.core import DSLError

rng = np.random.default_rng()


def randn(*shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def ids(lo, hi, shape):
    return rng.integers(lo, hi, shape).astype(np.int32)


def check(f, *args, donate=(), fusion=None, rtol=1e-5, atol=1e-5):
    """Run ``f`` on the CPU and in the float64 reference; compare; return (outputs, executable)."""
    jf = dsl.jit(f, backend="cpu", donate_argnums=donate, fusion=fusion)
    low = jf.lower(*args)
    want = low.program.run(*args, compute_dtype="f64")
    c = jf.compile(*args)
    got = dsl.tree_flatten(jf(*[np.copy(a) if isinstance(a, np.ndarray) else a for a in args]))[0]
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64), rtol=rtol, atol=atol)
    return got, c


def clamp(i, n):
    """numpy's index for JAX's gather rule: negative counted from the end once, then clamped."""
    return np.clip(np.where(i < 0, i + n, i), 0, n - 1)


# ----------------------------------------------------------------------------- gathers
X = (5, 6, 7)
GETITEMS = {                                    # name: (function of x, ids (3,), i, j), numpy of the same)
    "rows": (lambda x, a, i, j: x[a], lambda x, a, i, j: x[a]),
    "axis 1": (lambda x, a, i, j: x[:, a], lambda x, a, i, j: x[:, a]),
    "axis 2 after a slice": (lambda x, a, i, j: x[1:4, :, a], lambda x, a, i, j: x[1:4, :, a]),
    "ellipsis": (lambda x, a, i, j: x[..., a], lambda x, a, i, j: x[..., a]),
    "scalar": (lambda x, a, i, j: x[i], lambda x, a, i, j: x[i]),
    "scalars around a slice": (lambda x, a, i, j: x[i, :, j], lambda x, a, i, j: x[i, :, j]),
    "int and array apart": (lambda x, a, i, j: x[0, :, a], lambda x, a, i, j: x[0, :, a]),
    "arrays apart": (lambda x, a, i, j: x[a, 1:5, a], lambda x, a, i, j: x[a, 1:5, a]),
    "adjacent arrays": (lambda x, a, i, j: x[:, a, a[::-1]], lambda x, a, i, j: x[:, a, a[::-1]]),
    "static list, None": (lambda x, a, i, j: x[None, [4, 0, 2], ::2], lambda x, a, i, j: x[None, [4, 0, 2], ::2]),
    "reversed steps": (lambda x, a, i, j: x[::-2, 1, 5:0:-3], lambda x, a, i, j: x[::-2, 1, 5:0:-3]),
    "2-d index": (lambda x, a, i, j: x[:, a.reshape(1, 3) + a.reshape(3, 1)],
                  lambda x, a, i, j: x[:, a.reshape(1, 3) + a.reshape(3, 1)]),
}


@pytest.mark.parametrize("name", GETITEMS)
def test_getitem_with_traced_indices_is_numpy_indexing(name):
    f, ref = GETITEMS[name]
    x, a = randn(*X), ids(-3, 3, (3,))              # negative ids count from the end, in every axis
    i, j = int(rng.integers(-5, 5)), int(rng.integers(-7, 7))
    (got,), c = check(f, x, a, i, j)
    np.testing.assert_array_equal(got, ref(x, a, i, j))
    assert len(c.plan.kernels) == 1                 # a gather is a load inlined into its reader


def test_gathers_clamp_out_of_range_indices():
    x, a = randn(5, 6), np.array([-9, -6, -5, -1, 5, 40], np.int32)
    (rows, cols, one), _ = check(lambda x, a, i: (x[a], x[:, a], x[i, a]), x, a, 11)
    np.testing.assert_array_equal(rows, x[clamp(a, 5)])
    np.testing.assert_array_equal(cols, x[:, clamp(a, 6)])
    np.testing.assert_array_equal(one, x[4, clamp(a, 6)])


def test_gather_fuses_into_its_consumer_and_reads_f16_and_quantized_arrays():
    x, a = randn(4, 64, dtype=np.float16), ids(-4, 4, (3,))
    (got,), c = check(lambda x, a: dsl.exp(x[a[::-1], 3:40] * 0.5), x, a, rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(got, np.exp(x[a[::-1], 3:40].astype(np.float32) * 0.5), rtol=2e-3, atol=2e-3)
    assert [k.family for k in c.plan.kernels] == ["elementwise"]
    w = dsl.QArray.quantize(randn(3, 64), "q8_0")
    (got,), _ = check(lambda w, a: dsl.take(w, a, axis=1), w, ids(0, 64, (5,)))
    assert got.shape == (3, 5)


@pytest.mark.parametrize("mode", [None, "clip", "wrap", "fill"])
@pytest.mark.parametrize("axis", [0, 1, -1, None])
def test_take_along_any_axis_in_every_mode(axis, mode):
    x, a = randn(4, 5, 6), ids(-9, 9, (2, 3))
    (got,), _ = check(lambda x, a: dsl.take(x, a, axis=axis, mode=mode), x, a)
    flat = x.reshape(-1) if axis is None else x
    n = flat.shape[0 if axis is None else axis]
    if mode == "wrap":
        want = np.take(flat, a, axis=0 if axis is None else axis, mode="wrap")
    elif mode == "fill":
        i = np.where(a < 0, a + n, a)
        want = np.take(flat, np.clip(i, 0, n - 1), axis=0 if axis is None else axis)
        bad = (i < 0) | (i >= n)
        ax = 0 if axis is None else axis % flat.ndim
        bad = bad.reshape((1,) * ax + bad.shape + (1,) * (flat.ndim - ax - 1))
        want = np.where(bad, np.nan, want)
    else:
        want = np.take(flat, a, axis=0 if axis is None else axis, mode="clip")
    np.testing.assert_array_equal(got, want)


def test_numpy_take_on_a_traced_value_flattens_like_numpy():
    x, a = randn(3, 4), ids(0, 12, (5,))
    (flat, rows), _ = check(lambda x, a: (np.take(x, a), np.take(x, a[:2] * 0 + 1, axis=1)), x, a)
    np.testing.assert_array_equal(flat, np.take(x, a))
    np.testing.assert_array_equal(rows, x[:, [1, 1]])


def test_jnp_take_has_jax_defaults():
    import dsl.numpy as jnp
    x, a = randn(3, 4), np.array([0, 5, -1, 12, -13], np.int32)
    (got, rows), _ = check(lambda x, a: (jnp.take(x, a), jnp.take(x, a, axis=1, mode="clip")), x, a)
    want = x.reshape(-1)[np.clip(np.where(a < 0, a + 12, a), 0, 11)]
    np.testing.assert_array_equal(got, np.where((a >= 12) | (a < -12), np.nan, want))
    np.testing.assert_array_equal(rows, np.take(x, a, axis=1, mode="clip"))


def test_take_along_axis_broadcasts_and_counts_from_the_end():
    x = randn(3, 8, 5)
    a = ids(-8, 8, (3, 4, 1))                       # broadcasts along the last axis
    (got, top), _ = check(lambda x, a: (dsl.take_along_axis(x, a, 1), np.take_along_axis(x, a[:, :1], axis=1)), x, a)
    (flat, clip), _ = check(lambda x, a: (dsl.take_along_axis(x, a.reshape(-1), None),
                                          dsl.take_along_axis(x, a * 3, 1, mode="clip")), x, a)
    np.testing.assert_array_equal(flat, x.reshape(-1)[np.where(a < 0, a + 120, a).reshape(-1)])
    np.testing.assert_array_equal(clip, np.take_along_axis(x, np.broadcast_to(clamp(a * 3, 8), (3, 4, 5)), 1))
    np.testing.assert_array_equal(got, np.take_along_axis(x, np.broadcast_to(np.where(a < 0, a + 8, a), (3, 4, 5)), 1))
    assert top.shape == (3, 1, 5)
    (filled,), _ = check(lambda x, a: dsl.take_along_axis(x, a, 1, mode="fill"), x, a * 2)
    assert np.array_equal(np.isnan(filled[..., 0]), (a[..., 0] * 2 >= 8) | (a[..., 0] * 2 < -8))


def test_argmax_then_take_along_axis_gathers_the_maxima():
    x = randn(6, 9)
    (got,), _ = check(lambda x: dsl.take_along_axis(x, dsl.argmax(x, -1)[:, None], -1)[:, 0], x)
    np.testing.assert_array_equal(got, x.max(-1))


@pytest.mark.parametrize("dtype, axis", [("f32", -1), (np.float16, 0), ("bool", 1), (np.int32, -1)])
def test_one_hot_is_jax_one_hot(dtype, axis):
    a = ids(-2, 6, (3, 4))                          # out of [0, 5): a row of zeros, as JAX
    (got,), _ = check(lambda a: dsl.nn.one_hot(a, 5, dtype=dtype, axis=axis), a)
    want = np.moveaxis(a[..., None] == np.arange(5), -1, axis)
    assert got.dtype == np.dtype(dsl.core.NP_DTYPES[dtype] if isinstance(dtype, str) else dtype)
    np.testing.assert_array_equal(got, want.astype(got.dtype))


def test_dynamic_slice_clamps_its_starts_like_jax():
    x = randn(6, 7, 3)
    for s0, s1 in [(0, 0), (2, 4), (5, -3), (-2, 100)]:
        (got, row, cols), _ = check(lambda x, a, b: (dsl.lax.dynamic_slice(x, (a, b, 0), (3, 4, 3)),
                                                   dsl.lax.dynamic_index_in_dim(x, a, 0, keepdims=False),
                                                   dsl.lax.dynamic_slice_in_dim(x, b, 2, axis=1)), x, s0, s1)
        a, b = min(max(s0, 0), 3), min(max(s1, 0), 3)
        np.testing.assert_array_equal(got, x[a:a + 3, b:b + 4])
        np.testing.assert_array_equal(row, x[min(max(s0, 0), 5)])
        np.testing.assert_array_equal(cols, x[:, min(max(s1, 0), 5):min(max(s1, 0), 5) + 2])


def test_static_lax_slices():
    x = randn(6, 7)
    (a, b, c, d), _ = check(lambda x: (x[1:5:2, 0:7:3], dsl.lax.slice_in_dim(x, 2, 6, axis=1),
                                       dsl.lax.index_in_dim(x, -1, 1), dsl.lax.index_in_dim(x, 2, 0, keepdims=False)), x)
    np.testing.assert_array_equal(a, x[1:5:2, 0:7:3])
    np.testing.assert_array_equal(b, x[:, 2:6])
    np.testing.assert_array_equal(c, x[:, -1:])
    np.testing.assert_array_equal(d, x[2])


def test_dynamic_update_slice_and_index_in_dim():
    x, u = randn(6, 7), randn(2, 7)
    (got, one), _ = check(lambda x, u, p: (dsl.lax.dynamic_update_slice(x, u, (p, 0)),
                                           dsl.lax.dynamic_update_index_in_dim(x, u[0], p, 0)), x, u, 9)
    want = x.copy()
    want[4:6] = u
    np.testing.assert_array_equal(got, want)
    want = x.copy()
    want[5] = u[0]
    np.testing.assert_array_equal(one, want)


# ----------------------------------------------------------------------------- errors
ERRORS = {
    "mask": (lambda x, a: x[x > 0], "boolean mask.*dsl.where"),
    "static mask": (lambda x, a: x[np.array([True, False, True, True, False])], "boolean mask.*dsl.where"),
    "float index": (lambda x, a: x[a.astype("f32")], r"x\[\.\.\.\] index must be an integer array, got float32.*astype\('int32'\)"),
    "too many": (lambda x, a: x[a, 0, 1], r"too many indices \(3\) for an array of rank 2"),
    "static out of range": (lambda x, a: x[:, 9], "index 9 out of range for axis 1 of size 6"),
    "at with a mask": (lambda x, a: x.at[x > 0].set(0.0), "boolean mask.*dsl.where"),
    "at values": (lambda x, a: x.at[a].set(x), r"values of shape \[5, 6\] do not broadcast to the indexed shape \[3, 6\]"),
    "take_along_axis rank": (lambda x, a: dsl.take_along_axis(x, a, 0), "indices of the rank of arr"),
    "dynamic_slice starts": (lambda x, a: dsl.lax.dynamic_slice(x, (a[0],), (2, 2)),
                             r"sizes \[2, 2\] do not fit|one start index per dimension"),
    "dynamic_slice sizes": (lambda x, a: dsl.lax.dynamic_slice(x, (a[0], 0), (2, 9)), r"sizes \[2, 9\] do not fit"),
    "static list too long": (lambda x, a: x[:, list(range(-65, 0))], "static index array of 65 ids"),
}


@pytest.mark.parametrize("name", ERRORS)
def test_index_errors_name_the_line_and_the_fix(name):
    f, pattern = ERRORS[name]
    with pytest.raises(DSLError) as e:
        dsl.jit(f).lower(randn(5, 6), ids(0, 5, (3,)))
    msg = str(e.value)
    assert msg.startswith("tests/test_indexing.py:") and "\n" not in msg, msg
    assert re.search(pattern, msg), msg


# ----------------------------------------------------------------------------- functional updates
_COMBINE = {"add": np.add, "mul": np.multiply, "min": np.minimum, "max": np.maximum}


def np_at(x, where, vals, op):
    """``x.at[where].op(vals)`` for in-range ``where``, element by element in the row-major order
    of ``x[where]`` (numpy's own indexing says which element of ``x`` each one is)."""
    coords = [c[where] for c in np.indices(x.shape)]
    vals = np.broadcast_to(vals, coords[0].shape)
    out = x.copy()
    for p in np.ndindex(coords[0].shape):
        t = tuple(c[p] for c in coords)
        out[t] = vals[p] if op == "set" else _COMBINE[op](out[t], vals[p])
    return out


@pytest.mark.parametrize("op", ["set", "add", "mul", "min", "max"])
def test_at_updates_combine_repeated_indices_and_drop_out_of_range_ones(op):
    x, v = randn(6, 5), randn(7, 5)
    a = np.array([1, 4, -1, 1, 9, -7, 1], np.int32)         # repeats, a negative, out of range both ways
    (got,), c = check(lambda x, a, v: getattr(x.at[a], op)(v), x, a, v)
    keep = (a >= -6) & (a < 6)
    np.testing.assert_allclose(got, np_at(x, (a[keep],), v[keep], op), rtol=1e-6)
    assert [k.family for k in c.plan.kernels] == ["elementwise", "scatter"]      # a copy, then the scatter


@pytest.mark.parametrize("op", ["set", "add", "max"])
def test_at_with_slices_scalars_and_broadcast_values(op):
    x = randn(4, 6, 5)
    a, v, i = ids(-4, 4, (3,)), randn(3, 1), int(rng.integers(-4, 4))
    cases = [(lambda x, a, i, v: getattr(x.at[1:3, a], op)(v), lambda a, i, v: (np.s_[1:3, a], v)),
             (lambda x, a, i, v: getattr(x.at[i, :, 2], op)(2.5), lambda a, i, v: (np.s_[i, :, 2], 2.5)),
             (lambda x, a, i, v: getattr(x.at[:, a, ::2], op)(v[:, 0, None]),
              lambda a, i, v: (np.s_[:, a, ::2], v[:, 0, None])),
             (lambda x, a, i, v: getattr(x.at[a, 0, a], op)(v[:, 0]), lambda a, i, v: (np.s_[a, 0, a], v[:, 0])),
             (lambda x, a, i, v: getattr(x.at[..., a[:2]], op)(v[:2, 0]), lambda a, i, v: (np.s_[..., a[:2]], v[:2, 0]))]
    for f, ref in cases:
        (got,), _ = check(f, x, a, i, v)
        np.testing.assert_allclose(got, np_at(x, *ref(a, i, v), op), rtol=1e-6)


def test_at_get_and_unique_indices():
    x, a = randn(8, 4), rng.permutation(8)[:5].astype(np.int32)
    (got, upd), c = check(lambda x, a: (x.at[a].get(), x.at[a].set(x[a] * 2.0, unique_indices=True)), x, a)
    np.testing.assert_array_equal(got, x[a])
    want = x.copy()
    want[a] *= 2
    np.testing.assert_allclose(upd, want)
    scatter = next(k for k in c.plan.kernels if k.family == "scatter")
    from codegen import loopir as L
    assert all(s.parallel for s in L.walk_stmts(scatter.body) if isinstance(s, L.Loop))   # no serial loop


def test_at_clip_mode_clamps_instead_of_dropping():
    x, v = randn(5), randn(3)
    (got,), _ = check(lambda x, a, v: x.at[a].add(v, mode="clip"), x, np.array([-9, 2, 7], np.int32), v)
    want = x.copy()
    want[0] += v[0]
    want[2] += v[1]
    want[4] += v[2]
    np.testing.assert_allclose(got, want, rtol=1e-6)


# ----------------------------------------------------------------------------- in place on donation
def test_donated_at_update_is_written_in_place():
    x, v, a = randn(16, 8), randn(3, 8), np.array([3, 0, 3], np.int32)
    want = np_at(x, (a,), v, "add")
    f = dsl.jit(lambda x, a, v: x.at[a].add(v), donate_argnums=0)
    out = f(x, a, v)
    assert out is x                                  # the donated buffer itself
    np.testing.assert_allclose(out, want, rtol=1e-6)
    c = f.compile(x, a, v)
    assert list(c.plan.aliases.values()) == ["x"] and [k.family for k in c.plan.kernels] == ["scatter"]


def test_donated_state_updated_elementwise_is_written_in_place():
    """``state = state * decay + u`` with state donated: one kernel, no copy, the same buffer."""
    state, decay, u = randn(4, 32), randn(32), randn(4, 32)
    want = state * decay + u
    f = dsl.jit(lambda s, d, u: (s * d + u, dsl.sum(u)), donate_argnums=0)
    new, _ = f(state, decay, u)
    assert new is state
    np.testing.assert_allclose(new, want, rtol=1e-5, atol=1e-6)
    c = f.compile(state, decay, u)
    assert c.plan.aliases == {"s": "s"}
    assert sum("s" in [p.name for p in k.params if p.role != "in"] for k in c.plan.kernels) == 1


def test_donated_scalars_are_not_written_in_place():
    f = dsl.jit(lambda c, t, x: (c + 1, t * 0.5, x * 2.0), donate_argnums=(0, 1, 2))
    x = randn(3)
    c, t, y = f(4, 1.5, x.copy())
    assert int(c) == 5 and float(t) == 0.75
    np.testing.assert_allclose(y, x * 2.0)


SELF_UPDATES = {             # name: (function of (s, u), in place?)
    "elementwise": (lambda s, u: s * 0.5 + u, True),
    "old value read later": (lambda s, u: (s * 0.5 + u, dsl.sum(s, axis=1)), False),
    "old value returned": (lambda s, u: (s * 0.5 + u, s), False),
    "transposed read": (lambda s, u: s * 0.5 + s.T, False),
    "row reduction": (lambda s, u: s - dsl.max(s, axis=1, keepdims=True), False),
    "shifted read": (lambda s, u: s + dsl.concatenate([s[1:], s[:1]]), False),
    "gather of itself": (lambda s, u: s + s[dsl.argmax(u, -1)], False),
    "contraction of itself": (lambda s, u: s + s @ u, False),
    "contraction epilogue": (lambda s, u: s * 0.5 + u @ u.T, True),
    "full reduction first": (lambda s, u: s / dsl.sum(s * s) + u, True),
    "two outputs, the last in place": (lambda s, u: (s + 1.0, s * 2.0), True),
    "old value as a later view": (lambda s, u: (s * 2.0, s.reshape(64)), False),
    "old value as an earlier view": (lambda s, u: (lambda old: (s * 2.0, old))(s.reshape(64) + 0.0), True),
}


@pytest.mark.parametrize("name", SELF_UPDATES)
def test_in_place_only_when_no_other_read_of_the_old_value(name):
    f, in_place = SELF_UPDATES[name]
    s, u = randn(8, 8), randn(8, 8)
    _, c = check(f, s, u, donate=(0,), rtol=1e-4, atol=1e-4)
    assert bool(c.plan.aliases) == in_place, c.plan.aliases
    for k in c.plan.kernels:                         # a kernel writing s reads it only where it writes
        if any(p.name == "s" and p.role != "in" for p in k.params):
            assert in_place


def test_in_place_scatter_reads_its_updates_before_writing():
    """The update reads rows of the donated buffer the scatter overwrites: materialized first."""
    x = randn(6, 4)
    a = np.array([0, 1, 2], np.int32)
    (got,), c = check(lambda x, a: x.at[a + 1].set(x[a] * 2.0), x, a, donate=(0,))
    want = x.copy()
    want[1:4] = x[0:3] * 2
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert c.plan.aliases


@pytest.mark.parametrize("donate", [(), (0,)])
def test_an_update_by_its_own_operand_is_not_written_in_place(donate):
    """x.at[ids].set(x): the scatter reads x at p and writes it at ids[p] (found by the fuzzer,
    on a dead intermediate as the operand)."""
    x, a, b = randn(4), ids(-2, 4, (3,)), np.array([2, 0, 1], np.int32)
    (got, again), c = check(lambda x, a, b: (x.at[b].set(x[:3]), dsl.take(x, a).at[b].set(dsl.take(x, a))),
                            x, a, b, donate=donate)
    want = x.copy()
    want[b] = x[:3]
    np.testing.assert_array_equal(got, want)


def test_random_update_chains_on_a_donated_buffer_match_the_reference():
    """Chains of .at updates, elementwise self-updates, gathers and reads of older values."""
    for trial in range(12):
        steps = rng.integers(0, 5, 4)

        def f(s, a, u, steps=steps):
            olds, cur = [], s
            for k in steps:
                if k == 0:
                    cur = cur.at[a].add(u[:3])
                elif k == 1:
                    cur = cur * 0.9 + u
                elif k == 2:
                    olds.append(dsl.sum(cur[a], axis=1))
                elif k == 3:
                    cur = cur.at[:, a[0]].set(cur[:, 1] + 1.0)
                else:
                    cur = cur.at[a[::-1]].max(cur[a] * -1.0)
            return [cur] + olds
        s, a, u = randn(6, 5), ids(-7, 7, (3,)), randn(6, 5)
        check(f, s, a, u, donate=(0,))


# ----------------------------------------------------------------------------- gfx906
def test_gather_and_scatter_kernels_compile_for_gfx906():
    try:
        from engine.devices.rocm import HipUnavailable, compile_hip, find_hiprtc
        find_hiprtc()
    except (ImportError, HipUnavailable) as e:
        pytest.skip(f"hiprtc unavailable: {e}")
    from codegen.hip import render_hip
    from codegen.simplify import simplify
    from fusion import build_plan

    def f(x, a, i, v):
        y = dsl.exp(x[:, a]) + dsl.take_along_axis(x, a[None, :].astype("i32") + 0 * x[:, :3].astype("i32"), 1)
        return y, x.at[a].add(v), x[i, 1:], dsl.nn.one_hot(a, 8), dsl.lax.dynamic_slice(x, (i, 0), (2, 8))
    args = randn(8, 8), ids(0, 8, (3,)), 2, randn(3, 8)
    low = dsl.jit(f, donate_argnums=0).lower(*args)
    kernels = build_plan(low.program, None, low.in_names, low.donated).kernels
    assert any(e.prim.name == "scatter" for k in kernels for e in k.eqns)
    for k in kernels:
        src = render_hip(simplify(k), "gfx906").source
        compile_hip(src, k.name)


def test_random_indexing_programs_compile_for_gfx906():
    """Kernels of random programs with gathers and .at updates (tests/fuzz.py) compile for gfx906."""
    try:
        from engine.devices.rocm import HipUnavailable, compile_hip, find_hiprtc
        find_hiprtc()
    except (ImportError, HipUnavailable) as e:
        pytest.skip(f"hiprtc unavailable: {e}")
    from codegen.hip import render_hip
    from codegen.simplify import simplify
    from fusion import build_plan
    from tests import fuzz
    seed, done = int(rng.integers(2 ** 31)), 0
    for i in range(300):
        try:
            src, _ = fuzz.program_source(seed, i)
        except DSLError:
            continue
        if ".at[" not in src and "axis=" not in src:
            continue
        ns = {}
        exec(src.split("jf = dsl.jit(")[0], ns)
        donate = (0,) if "donate_argnums" in src else ()
        low = dsl.jit(ns["f"], donate_argnums=donate).lower(*ns["args"])
        for k in build_plan(low.program, None, low.in_names, low.donated).kernels:
            compile_hip(render_hip(simplify(k), "gfx906").source, k.name)
        done += 1
        if done == 10:
            break
    assert done == 10, f"seed {seed}: only {done} programs with indexing"


def test_expert_rows_picked_by_indexing_are_read_inside_the_gemv():
    """``w[e]`` (a routed expert id from argmax) is the take that the GEMV reads through: only the
    chosen expert's weights are read (the MoE case of tests/test_moe.py, written with indexing)."""
    from codegen.loopir import buffer_traffic
    E, D, F = 8, 64, 128
    x, wr, wg = randn(1, D), randn(E, D), randn(E, F, D) * D ** -0.5

    def f(x, wr, wg):
        e = dsl.argmax((x @ wr.T)[0])
        return x @ wg[e].T
    (got,), c = check(f, x, wr, wg, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got, x @ wg[np.argmax(x @ wr.T)].T, rtol=1e-4, atol=1e-4)
    read = sum(buffer_traffic(k).get("wg", 0) for k in c.plan.kernels)
    assert read == wg.nbytes // E


def test_kernels_are_named_after_what_they_do_not_their_index_arithmetic():
    x, i, v = randn(6, 5), ids(0, 6, (3,)), randn(3, 5)
    names = [[k.name for k in dsl.jit(f).compile(x, i, v).plan.kernels]
             for f in (lambda x, i, v: x[i], lambda x, i, v: x[i[0], 1:] * 2.0, lambda x, i, v: x.at[i].add(v),
                       lambda x, i, v: x[i] * (i > 0)[:, None])]
    assert names == [["take"], ["mul"], ["kernel", "scatter"], ["gt_mul"]]
