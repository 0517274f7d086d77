"""User-facing errors of the engine.

The CLI catches :class:`ModelError`, prints ``str(err)`` as one line and exits
with status 2.  Messages name the file (and tensor / shape where relevant) and
say how to fix the problem.
"""


class ModelError(Exception):
    """A model file or directory cannot be used (missing, corrupt, unsupported).

    The message is a single line meant for the end user: it names the file,
    the tensor and shapes involved where relevant, and the fix.
    """


def run_cli(run, args) -> int:
    """Run a command's ``run(args)``: a ``ModelError``, ``ValueError`` or ``DSLError`` (bad input)
    prints one line ``error: ...`` and returns 2, as does a GPU backend that cannot start; Ctrl-C
    returns 130; a reader that went away (``| head``) ends quietly."""
    import sys
    from dsl.core import DSLError
    try:
        return run(args)
    except (ModelError, ValueError, DSLError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:                  # a GPU backend that cannot start (no driver, no device)
        if type(e).__name__ not in ("CudaError", "HipUnavailable", "HipError"):
            raise
        print(f"error: {str(e).splitlines()[0]}; use --backend cpu", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:                    # the reader went away (e.g. | head)
        sys.stderr.close()
        return 0
