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
