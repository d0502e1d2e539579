"""``python -m lapheads`` (what torchrun launches) is the same as the ``lapheads`` command."""

from lapheads.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
