"""Library messages through :mod:`logging`, as transformers and timm send theirs: one logger per module
(``logging.getLogger(__name__)``), every one under the ``lapheads`` logger.

Design choices:

* **A library user sees warnings; the command shows everything it always printed.** The ``lapheads`` logger's level
  is WARNING for a library import (``set_verbosity(logging.INFO)``, or ``LAPHEADS_VERBOSITY=info`` in the
  environment, shows progress and notices too); the ``lapheads`` command sets INFO, so its terminal output is the one
  the prints gave.
* **One handler of its own, writing the bare message to the current ``sys.stderr``**, looked up at each message: a
  redirected or captured stderr (pytest's ``capsys``, a notebook) receives it, as a print did. Messages keep their own
  ``lapheads:`` prefix where they had one, so the terminal reads as before.
* **No propagation by default** (transformers' choice): an application whose root logger prints would otherwise show
  each message twice. :func:`enable_propagation` hands them to the root logger instead, without lapheads' handler, for
  an application that routes logs itself (to a file, to a cluster's collector).
* Results are not messages: what a command answers (a JSON line, a report) is printed by the CLI layer
  (``lapheads.cli``, ``lapheads.apps``), never logged.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["enable_propagation", "get_verbosity", "set_verbosity"]

ROOT = "lapheads"
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class _CurrentStderr(logging.StreamHandler):
    """A handler that writes to whatever ``sys.stderr`` is when a message is emitted (not the one at import)."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(message)s"))

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it: the property answers instead
        pass


def _root() -> logging.Logger:
    return logging.getLogger(ROOT)


def _level(level: int | str) -> int:
    if isinstance(level, str) and level.strip().lower() in _LEVELS:
        return _LEVELS[level.strip().lower()]
    if isinstance(level, int) and not isinstance(level, bool) and level >= 0:
        return level
    raise ValueError(f"verbosity {level!r}; allowed: {', '.join(_LEVELS)} or a logging level number")


def set_verbosity(level: int | str) -> None:
    """Show lapheads' messages at ``level`` and above (``logging.INFO`` or "info": progress and notices too;
    the default ``logging.WARNING``: warnings only)."""
    _root().setLevel(_level(level))


def get_verbosity() -> int:
    """The level of lapheads' messages now shown (a :mod:`logging` level number)."""
    return _root().getEffectiveLevel()


def enable_propagation(enabled: bool = True) -> None:
    """Hand lapheads' messages to the root logger (and drop lapheads' own stderr handler), or take them back."""
    root = _root()
    root.propagate = enabled
    own = [handler for handler in root.handlers if isinstance(handler, _CurrentStderr)]
    if enabled:
        for handler in own:
            root.removeHandler(handler)
    elif not own:
        root.addHandler(_CurrentStderr())


def configure_library() -> None:
    """The defaults above, once per interpreter (``import lapheads`` calls it): lapheads' handler, no propagation,
    WARNING unless ``LAPHEADS_VERBOSITY`` names another level."""
    root = _root()
    if any(isinstance(handler, _CurrentStderr) for handler in root.handlers):
        return
    root.addHandler(_CurrentStderr())
    root.propagate = False
    wanted = os.environ.get("LAPHEADS_VERBOSITY")
    try:
        root.setLevel(_level(wanted) if wanted else logging.WARNING)
    except ValueError as error:
        root.setLevel(logging.WARNING)
        root.warning(f"lapheads: LAPHEADS_VERBOSITY: {error}")
