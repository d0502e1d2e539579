"""Adapters to other ecosystems (optional extras): lm-evaluation-harness (:mod:`lapheads.integrations.lm_eval`)."""

from lapheads.submodules import submodule_getattr  # noqa: E402 - after the docstring and names above

__getattr__ = submodule_getattr(__name__)  # its modules by attribute: lapheads.integrations.<module>
