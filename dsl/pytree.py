"""Pytrees: nested dicts, lists and tuples (and None) of leaves, as in JAX.

``flatten(tree) -> (leaves, treedef)``; ``unflatten(treedef, leaves) -> tree``.
Dict keys are visited in sorted order, so the treedef is hashable and stable.
"""
from __future__ import annotations


def flatten(tree):
    leaves = []

    def rec(t):
        if isinstance(t, dict):
            keys = sorted(t)
            return ("dict", tuple(keys), tuple(rec(t[k]) for k in keys))
        if isinstance(t, (list, tuple)):
            return ("list" if isinstance(t, list) else "tuple", len(t), tuple(rec(x) for x in t))
        if t is None:
            return ("none",)
        leaves.append(t)
        return ("leaf",)
    return leaves, rec(tree)


def unflatten(treedef, leaves):
    it = iter(leaves)

    def rec(d):
        kind = d[0]
        if kind == "leaf":
            return next(it)
        if kind == "none":
            return None
        if kind == "dict":
            return {k: rec(c) for k, c in zip(d[1], d[2])}
        items = [rec(c) for c in d[2]]
        return items if kind == "list" else tuple(items)
    return rec(treedef)


def tree_map(f, tree):
    leaves, td = flatten(tree)
    return unflatten(td, [f(x) for x in leaves])
