"""Training: one module per task (``classify``, ``lm``, ``chat``, ``dino``) on the shared ``runtime``; each is
imported on first use through the task table (``lapheads.tasks``), never by this package."""

from lapheads.submodules import submodule_getattr  # noqa: E402 - after the docstring and names above

__getattr__ = submodule_getattr(__name__)  # its modules by attribute: lapheads.train.<module>
