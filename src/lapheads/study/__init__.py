"""Studies over runs: analyze (geometry side by side), sweeps, reports with the verdict rule, the demo, mix heads."""

from lapheads.submodules import submodule_getattr  # noqa: E402 - after the docstring and names above

__getattr__ = submodule_getattr(__name__)  # its modules by attribute: lapheads.study.<module>
