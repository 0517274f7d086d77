"""Execution devices: each compiles Loop IR kernels (``codegen.loopir.Kernel``) and launches them."""
