"""The error types a user can cause. The CLI prints these as one line and exits non-zero; anything else is a bug
and keeps its traceback.

Each subclasses the built-in type it used to be (``ValueError`` for bad values, ``RuntimeError`` for bad state), so
``except ValueError`` in user code keeps working.
"""

from __future__ import annotations

__all__ = ["CheckpointError", "InputError", "LapheadsError", "SweepError"]


class LapheadsError(Exception):
    """Base of every error caused by the user's input or environment; the message is one line that names the bad
    value and what is allowed."""


class InputError(LapheadsError, ValueError):
    """A bad argument to a lapheads function (a shape, a name, a size); the message names it and what is allowed."""


class CheckpointError(LapheadsError, RuntimeError):
    """A checkpoint or run directory that is missing, corrupt, unsafe or does not match the model; one line."""


class SweepError(LapheadsError, ValueError):
    """A bad sweep definition, sweep folder or report request; one-line message."""
