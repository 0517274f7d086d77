"""Printing a Program as jaxpr-like text, and parsing that text back (``lark``).

    { lambda a:f32[1,576] b:i32[] ;
      let c:f32[1,576] = mul a a
          d:f32[1] = reduce_sum c
      in ( d ) }

Parameters print as ``prim[name=value, ...]``; values are ints, floats
(Python ``repr``), True/False, bare words (dtype names) and tuples.
``parse_ir(print_program(p))`` prints identically and evaluates the same.
"""
from __future__ import annotations

import inspect
import itertools
import string

from lark import Lark, Transformer

from .core import PRIMITIVES, DSLError, Eqn, Lit, Program, Var

_RESERVED = {"in", "let", "lambda", "True", "False", "inf", "nan"}


def _names():
    for n in itertools.count(1):
        for t in itertools.product(string.ascii_lowercase, repeat=n):
            s = "".join(t)
            if s not in _RESERVED:
                yield s


def _type(v):
    return f"{v.dtype}[{','.join(str(d) for d in v.shape)}]"


def _value(v):
    if isinstance(v, bool):
        return "True" if v else "False"
    if isinstance(v, (tuple, list)):
        inner = ",".join(_value(x) for x in v)
        return f"({inner},)" if len(v) == 1 else f"({inner})"
    if isinstance(v, float):
        return repr(v)
    return str(v)


def print_program(prog: Program, gen=None, pad="") -> str:
    """The IR text of ``prog``.  A loop's body (a Program parameter) prints nested, in braces, the
    first time; the other equations of the same loop name the equation that printed it
    (``body=d``).  ``gen``, ``pad``: the name generator and indentation of an enclosing program."""
    gen = gen or _names()
    names, bodies = {}, {}

    def param(e, v):
        if not isinstance(v, Program):
            return _value(v)
        if id(v) in bodies:
            return bodies[id(v)]
        bodies[id(v)] = names[e.out]
        return print_program(v, gen, pad + "        ")

    def name(v):
        if v not in names:
            names[v] = next(gen)
        return names[v]

    def atom(a):
        return f"{_value(a.value)}:{a.dtype}" if isinstance(a, Lit) else names[a]

    head = " ".join(f"{name(v)}:{_type(v)}" for v in prog.inputs)
    lines = [f"{{ lambda {head} ;"]
    for i, e in enumerate(prog.eqns):
        params = ""
        lhs = f"{name(e.out)}:{_type(e.out)}"
        if e.params:
            params = "[" + ", ".join(f"{k}={param(e, v)}" for k, v in sorted(e.params.items())) + "]"
        args = " ".join(atom(a) for a in e.inputs)
        lines.append(f"{pad}  {'let' if i == 0 else '   '} {lhs} = {e.prim.name}{params}{' ' + args if args else ''}")
    if not prog.eqns:
        lines.append(f"{pad}  let")
    outs = " ".join(atom(o) for o in prog.outputs)
    lines.append(f"{pad}  in ( {outs} ) }}")
    return "\n".join(lines)


GRAMMAR = r"""
program: "{" "lambda" binder* ";" "let" eqn* "in" "(" atom* ")" "}"
binder: VARDEF ":" type
type: DTYPE "[" [INT ("," INT)*] "]"
eqn: binder "=" NAME params? atom*
params: "[" param ("," param)* "]"
param: NAME "=" value
?value: NUMBER -> number
      | BOOL -> boolean
      | NAME -> word
      | "(" [value ("," value)* ","?] ")" -> tuple
      | program
atom: NAME -> ref
    | literal
literal: (NUMBER | BOOL) ":" DTYPE
BOOL.4: "True" | "False"
VARDEF.3: /(?!(?:inf|nan|True|False)(?![a-zA-Z0-9_]))[a-zA-Z_][a-zA-Z0-9_]*(?=:)/
DTYPE.2: /(f32|f16|i32|bool|f64|q4_0|q4_1|q8_0|gptq_int4)(?=[\[\s)])/
NUMBER.2: /-?(inf|nan|\d+(\.\d*)?([eE][-+]?\d+)?)(?![a-zA-Z_])/
NAME: /[a-zA-Z_][a-zA-Z0-9_]*/
INT: /\d+/
%ignore /\s+/
"""

_parser = Lark(GRAMMAR, start="program", parser="lalr")


def _num(tok):
    s = str(tok)
    return float(s) if any(ch in s for ch in ".enai") else int(s)


class _Build(Transformer):
    def __init__(self):
        super().__init__()
        self.env = {}

    def type(self, items):
        dtype, *dims = items
        return str(dtype), tuple(int(d) for d in dims if d is not None)

    def binder(self, items):
        name, (dtype, shape) = items
        v = Var(shape, dtype)
        return str(name), v

    def number(self, items):
        return _num(items[0])

    def boolean(self, items):
        return str(items[0]) == "True"

    def word(self, items):
        return str(items[0])

    def tuple(self, items):
        return tuple(x for x in items if x is not None)

    def param(self, items):
        return str(items[0]), items[1]

    def params(self, items):
        return dict(items)

    def literal(self, items):
        tok, dtype = items
        v = (str(tok) == "True") if tok.type == "BOOL" else _num(tok)
        dtype = str(dtype)
        return Lit(float(v) if dtype in ("f32", "f16", "f64") else v if dtype == "bool" else int(v), dtype)

    def ref(self, items):
        return ("ref", str(items[0]))

    def atom(self, items):
        return items[0]

    def eqn(self, items):
        (name, out), prim, *rest = items
        params = rest[0] if rest and isinstance(rest[0], dict) else {}
        atoms = rest[1:] if rest and isinstance(rest[0], dict) else rest
        return ("eqn", name, out, str(prim), params, atoms)

    def program(self, items):
        binders = [x for x in items if isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], Var)]
        eqns = [x for x in items if isinstance(x, tuple) and x and x[0] == "eqn"]
        outs = [x for x in items if not (x in binders or x in eqns)]
        env = {}
        for name, v in binders:
            if name in env:
                raise DSLError(f"IR text: input {name!r} is declared twice")
            env[name] = v

        def resolve(a):
            if isinstance(a, tuple) and a[0] == "ref":
                if a[1] not in env:
                    raise DSLError(f"IR text: undefined variable {a[1]!r}")
                return env[a[1]]
            return a
        built, made = [], {}
        for _, name, out, prim, params, atoms in eqns:
            if isinstance(params.get("body"), str):        # body=d: the body printed with equation d
                if params["body"] not in made or "body" not in made[params["body"]].params:
                    raise DSLError(f"IR text: {name} = {prim}: body={params['body']} names no earlier loop")
                params = dict(params, body=made[params["body"]].params["body"])
            if prim not in PRIMITIVES:
                raise DSLError(f"IR text: unknown primitive {prim!r}")
            if name in env:
                raise DSLError(f"IR text: {name!r} is defined twice")
            p = PRIMITIVES[prim]
            ins = [resolve(a) for a in atoms]
            allowed = {n for n, q in inspect.signature(p.rule).parameters.items() if q.kind == q.KEYWORD_ONLY}
            if set(params) - allowed:
                raise DSLError(f"IR text: {name} = {prim}: unknown parameter(s) {sorted(set(params) - allowed)}"
                               f"; {prim} takes {sorted(allowed) or 'none'}")
            try:
                shape, dtype = p.rule([(a.shape, a.dtype) for a in ins], **params)
            except (DSLError, TypeError, ValueError) as e:
                raise DSLError(f"IR text: {name} = {prim}: {e}") from None
            if (tuple(shape), dtype) != (out.shape, out.dtype):
                raise DSLError(f"IR text: {name} declared {_type(out)} but {prim} gives {dtype}{list(shape)}")
            env[name] = out
            built.append(Eqn(p, ins, params, out))
            made[name] = built[-1]
        return Program([v for _, v in binders], built, [resolve(o) for o in outs])


def parse_ir(text: str) -> Program:
    """Parse IR text (as printed by ``Program.as_text()``) into a Program.

    Raises DSLError for an unknown primitive, an undefined name or a declared
    type that contradicts the primitive's rule, or text that does not parse."""
    from lark.exceptions import LarkError, VisitError
    if not isinstance(text, str):
        raise DSLError(f"parse_ir needs IR text (str), got {type(text).__name__}")
    try:
        tree = _parser.parse(text)
        return _Build().transform(tree)
    except VisitError as e:
        raise e.orig_exc if isinstance(e.orig_exc, DSLError) else DSLError(f"IR text: {e.orig_exc}") from None
    except LarkError as e:
        raise DSLError(f"IR text does not parse: {str(e).splitlines()[0]}") from None
