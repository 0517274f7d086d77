"""Pytrees, as in ``jax.tree_util``: nested containers of leaves.

Nodes: dicts (keys visited in sorted order), lists, tuples, namedtuples, None (a node with no
children), and any class registered with ``register_pytree_node``,
``register_pytree_node_class`` or ``register_dataclass``.  Everything else is a leaf.  As in JAX,
a dataclass is a leaf until it is registered (``QArray``, a dataclass, is a leaf: one weight).

    leaves, treedef = tree_flatten(tree)      # treedef: hashable, compared for equality
    tree = tree_unflatten(treedef, leaves)
    tree_map(f, tree, *rest)                  # f on the leaves of trees of one structure
    tree_flatten_with_path(tree)              # ([(path, leaf)], treedef), path a tuple of keys,
                                              # indices and field names (JAX wraps each in a KeyEntry)

``dsl.tree_util`` is this module.
"""
from __future__ import annotations

import dataclasses

_NODES: dict = {}       # type -> (flatten(x) -> (children, aux, keys), unflatten(aux, children) -> x)


def register_pytree_node(nodetype, flatten_func, unflatten_func):
    """Make ``nodetype`` a pytree node, as ``jax.tree_util.register_pytree_node``:
    ``flatten_func(x) -> (children, aux_data)`` (``aux_data`` hashable: it is part of the treedef
    and of ``jit``'s cache key), ``unflatten_func(aux_data, children) -> x``."""
    def flat(x):
        children, aux = flatten_func(x)
        children = list(children)
        return children, aux, tuple(range(len(children)))
    _NODES[nodetype] = (flat, unflatten_func)
    return nodetype


def register_pytree_node_class(cls):
    """Class decorator, as in JAX: ``cls.tree_flatten(self) -> (children, aux_data)`` and the
    classmethod ``cls.tree_unflatten(aux_data, children)``."""
    return register_pytree_node(cls, lambda x: x.tree_flatten(), cls.tree_unflatten)


def register_dataclass(nodetype=None, data_fields=None, meta_fields=None, drop_fields=()):
    """Make a ``@dataclass`` a pytree node, as ``jax.tree_util.register_dataclass`` (usable as a
    decorator).  ``data_fields`` are children (arrays), ``meta_fields`` static values kept in the
    treedef (hashable; a change retraces ``jit``).  Without them, every field is data except those
    declared ``dataclasses.field(metadata={"static": True})``.  Fields with ``init=False`` or in
    ``drop_fields`` are not kept.

    Raises ``TypeError`` for a class that is not a dataclass or a field list that does not name
    each ``__init__`` field once."""
    if nodetype is None:
        return lambda cls: register_dataclass(cls, data_fields, meta_fields, drop_fields)
    if not dataclasses.is_dataclass(nodetype):
        raise TypeError(f"register_dataclass: {nodetype.__name__} is not a dataclass; "
                        "decorate it with @dataclass first")
    init = [f for f in dataclasses.fields(nodetype) if f.init and f.name not in drop_fields]
    if data_fields is None and meta_fields is None:
        meta_fields = [f.name for f in init if f.metadata.get("static", False)]
        data_fields = [f.name for f in init if not f.metadata.get("static", False)]
    data_fields, meta_fields = list(data_fields or ()), list(meta_fields or ())
    if sorted(data_fields + meta_fields) != sorted(f.name for f in init):
        raise TypeError(f"register_dataclass: data_fields {data_fields} and meta_fields {meta_fields} of "
                        f"{nodetype.__name__} must name each of its fields {[f.name for f in init]} once")

    def flat(x):
        return ([getattr(x, n) for n in data_fields], tuple(getattr(x, n) for n in meta_fields), tuple(data_fields))

    def unflat(aux, children):
        return nodetype(**dict(zip(data_fields, children)), **dict(zip(meta_fields, aux)))
    _NODES[nodetype] = (flat, unflat)
    return nodetype


def _is_namedtuple(t):
    return isinstance(t, tuple) and hasattr(type(t), "_fields")


def _node(t):
    """(kind, aux, children, keys) of a node, or None for a leaf."""
    if isinstance(t, dict):
        keys = tuple(sorted(t))
        return "dict", keys, [t[k] for k in keys], keys
    if _is_namedtuple(t):
        return "namedtuple", type(t), list(t), tuple(type(t)._fields)
    if type(t) in _NODES:
        children, aux, keys = _NODES[type(t)][0](t)
        return "node", (type(t), aux), children, keys
    if isinstance(t, (list, tuple)):
        return "list" if isinstance(t, list) else "tuple", len(t), list(t), tuple(range(len(t)))
    if t is None:
        return "none", None, [], ()
    return None


def tree_flatten_with_path(tree, is_leaf=None):
    """``([(path, leaf), ...], treedef)``: each leaf with the keys leading to it (dict keys, list
    indices, namedtuple and dataclass field names), in ``tree_flatten`` order.  ``is_leaf(x)``
    true stops the walk at ``x`` (a leaf, even a tuple or dict), as in JAX."""
    out = []

    def rec(t, path):
        node = None if is_leaf is not None and is_leaf(t) else _node(t)
        if node is None:
            out.append((path, t))
            return ("leaf",)
        kind, aux, children, keys = node
        return (kind, aux, tuple(rec(c, path + (k,)) for c, k in zip(children, keys)))
    return out, rec(tree, ())


def flatten(tree, is_leaf=None):
    """``(leaves, treedef)``, as ``jax.tree_util.tree_flatten`` (``is_leaf`` as there)."""
    pairs, treedef = tree_flatten_with_path(tree, is_leaf)
    return [x for _, x in pairs], treedef


def unflatten(treedef, leaves):
    """The tree of ``treedef`` with ``leaves`` in flatten order (``jax.tree_util.tree_unflatten``)."""
    it = iter(leaves)

    def rec(d):
        kind = d[0]
        if kind == "leaf":
            return next(it)
        children = [rec(c) for c in d[2]]
        if kind == "none":
            return None
        if kind == "dict":
            return dict(zip(d[1], children))
        if kind == "namedtuple":
            return d[1](*children)
        if kind == "node":
            cls, aux = d[1]
            return _NODES[cls][1](aux, children)
        return children if kind == "list" else tuple(children)
    return rec(treedef)


def tree_map(f, tree, *rest, is_leaf=None):
    """``f`` applied to the leaves of ``tree`` (and the matching leaves of each of ``rest``, trees of
    the same structure), as ``jax.tree_util.tree_map``; ``is_leaf`` as in ``flatten``."""
    leaves, td = flatten(tree, is_leaf)
    others = []
    for r in rest:
        lv, rd = flatten(r, is_leaf)
        if rd != td:
            raise ValueError("tree_map: the trees have different structures")
        others.append(lv)
    return unflatten(td, [f(x, *xs) for x, *xs in zip(leaves, *others)])


def tree_leaves(tree, is_leaf=None):
    return flatten(tree, is_leaf)[0]


def tree_structure(tree, is_leaf=None):
    return flatten(tree, is_leaf)[1]


def tree_reduce(function, tree, *initializer, is_leaf=None):
    """``functools.reduce(function, tree_leaves(tree), *initializer)``, as ``jax.tree_util.tree_reduce``."""
    import functools
    return functools.reduce(function, tree_leaves(tree, is_leaf), *initializer)


tree_flatten, tree_unflatten = flatten, unflatten


def describe(treedef) -> str:
    """A short readable form of a treedef, for error messages: ``(*, {a: *, b: *})``."""
    kind = treedef[0]
    if kind == "leaf":
        return "*"
    parts = [describe(c) for c in treedef[2]]
    if kind == "dict":
        return "{" + ", ".join(f"{k}: {p}" for k, p in zip(treedef[1], parts)) + "}"
    if kind == "none":
        return "None"
    if kind == "namedtuple":
        return f"{treedef[1].__name__}(" + ", ".join(parts) + ")"
    if kind == "node":
        return f"{treedef[1][0].__name__}(" + ", ".join(parts) + ")"
    if kind == "list":
        return "[" + ", ".join(parts) + "]"
    return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"
