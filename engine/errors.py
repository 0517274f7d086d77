"""User-facing errors of the engine, and the argument parser its commands share.

The commands catch :class:`ModelError` (and ValueError, DSLError) in :func:`run_cli`, print
``str(err)`` as one line ``error: ...`` and exit with status 2; :class:`Parser` does the same for
bad options.  Messages name the file (and tensor / shape where relevant) and say how to fix the
problem.
"""
import argparse
import os
import sys


class ModelError(Exception):
    """A model file or directory cannot be used (missing, corrupt, unsupported).

    The message is a single line meant for the end user: it names the file,
    the tensor and shapes involved where relevant, and the fix.
    """


def package_version() -> str:
    """The installed vegafuse distribution's version (str), or "0+unknown" when it is not installed."""
    from importlib import metadata
    try:
        return metadata.version("vegafuse")
    except metadata.PackageNotFoundError:
        return "0+unknown"


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` for the engine's commands.

    ``Parser(module, description)``: the program calls itself by the name it was run as
    (``vegafuse-generate`` for the installed script, else ``python -m engine.generate``), has
    ``--version``, and reports a bad option as one line ``error: ...`` with exit status 2."""

    def __init__(self, module: str, description: str, **kw):
        script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
        prog = script if script.startswith("vegafuse-") else f"python -m {module}"
        super().__init__(prog=prog, description=description, **kw)
        self.add_argument("--version", action="version", version=f"vegafuse {package_version()}")

    def error(self, message):
        self.exit(2, f"error: {message}; see {self.prog} --help\n")


def run_cli(run, args) -> int:
    """Run a command's ``run(args)``: a ``ModelError``, ``ValueError`` or ``DSLError`` (bad input)
    prints one line ``error: ...`` and returns 2, as does a GPU backend that cannot start; Ctrl-C
    returns 130; a reader that went away (``| head``) ends quietly.  A GPU ``args.backend`` that
    cannot run here (``devices.probe.check_backend``) fails before ``run`` loads anything."""
    try:
        if getattr(args, "backend", None) in ("cuda", "hip"):
            from .devices.probe import check_backend
            check_backend(args.backend, getattr(args, "gpu_only", ""))
        return run(args)
    except Exception as e:
        core = sys.modules.get("dsl.core")            # a DSLError needs dsl loaded: not imported here
        if isinstance(e, (ModelError, ValueError)) or (core and isinstance(e, core.DSLError)):
            print(f"error: {e}", file=sys.stderr)
            return 2
        if isinstance(e, BrokenPipeError):            # the reader went away (e.g. | head)
            sys.stderr.close()
            return 0
        # a GPU backend that cannot start (no driver, no device)
        if not isinstance(e, RuntimeError) or type(e).__name__ not in ("CudaError", "HipUnavailable", "HipError"):
            raise
        print(f"error: {str(e).splitlines()[0]}; use --backend cpu", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
