"""Fusion: partition a traced Program into kernels by named rules, and lower them to Loop IR."""
from .partition import RULES, enabled_rules  # noqa: F401
from .schedule import Plan, build_plan  # noqa: F401
