"""A user-defined primitive in one call: softplus as a Loop IR expression.

    python3 examples/softplus_primitive.py

softplus(x) = log1p(exp(x)), written in the numerically stable form
max(x, 0) + log1p(exp(-|x|)) in Loop IR ops (codegen.loopir.OPS).  With its shape rule and its
numpy reference it becomes a primitive like dsl.exp: it fuses into the GEMV's epilogue, shows
as one op in the traced IR and the Loop IR, and both renderers (LLVM for the CPU, HIP C++ for
gfx906 and NVIDIA) spell it from the expression.
"""
import numpy as np

import dsl
from codegen.hip import render_hip
from codegen.loopir import OPS, format_kernel
from stdlib import nn


def float_rule(avals):
    """One float input; the output has its shape and dtype."""
    (shape, dtype), = avals
    if dtype not in ("f32", "f16"):
        raise dsl.DSLError(f"softplus needs a float input, got {dtype}; convert with .astype('f32')")
    return shape, dtype


# log1p is a Loop IR op once dsl.log1p is; before that log(1 + u) is the same expression, less
# accurate where exp(-|x|) is below f32's epsilon
LOG1P = "log1p({u})" if "log1p" in OPS else "log(add(1.0, {u}))"
softplus = dsl.define_elementwise(
    "my_softplus", float_rule, lambda x: np.logaddexp(0.0, x),
    f"add(max(x, 0.0), {LOG1P.format(u='exp(neg(abs(x)))')})")


@dsl.jit
def layer(x, w, b):                       # x (1, K), w (N, K), b (N,)
    return softplus(nn.linear(x, w) + b)  # one kernel: the GEMV, bias and softplus in its epilogue


if __name__ == "__main__":
    rng = np.random.default_rng()
    x = rng.standard_normal((1, 256)).astype(np.float32)
    w = (rng.standard_normal((128, 256)) / 8).astype(np.float32)
    b = rng.standard_normal(128).astype(np.float32)

    lowered = layer.lower(x, w, b)
    print(lowered.as_text())                                    # ... = my_softplus f
    assert dsl.parse_ir(lowered.as_text()).as_text() == lowered.as_text()

    compiled = layer.compile(x, w, b)
    print(compiled.fusion_report())                             # 1 kernel: dot, ..., my_softplus
    (kernel,) = compiled.plan.kernels
    print(format_kernel(kernel))                                # f[n] = my_softplus(add(acc, b[n]))
    print(render_hip(kernel, "gfx906").body)                    # the expression, spelled in C

    got = compiled(x, w, b)
    want = np.logaddexp(0.0, x.astype(np.float64) @ w.T.astype(np.float64) + b)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    print(f"max |error| against numpy float64: {np.abs(got - want).max():.2e}")
