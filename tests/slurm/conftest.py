"""A real one-node SLURM cluster for the SLURM tests, started once per session (as root: installed with apt-get and
started by tests/slurm/localhost_cluster.sh); elsewhere the tests are skipped with the one line that says how."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.study.conftest import tiny_preset  # noqa: F401 - the sweep tests' tiny preset, here too

SCRIPT = Path(__file__).with_name("localhost_cluster.sh")
HOW = f"needs a SLURM cluster: run `sudo bash {SCRIPT}` (a one-node cluster on localhost) or run on a login node"


@pytest.fixture(scope="session")
def slurm_cluster() -> str:
    """The partition of a running cluster: this machine's own one-node cluster when we are root, else the cluster
    sbatch already reaches (LAPHEADS_TEST_PARTITION names its partition)."""
    pytest.importorskip("submitit", reason="pip install 'lapheads[slurm]'")
    if os.geteuid() == 0 and shutil.which("apt-get"):
        started = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=900)
        if started.returncode != 0:
            pytest.fail(f"the localhost SLURM cluster did not start: {started.stderr.strip()}")
        return started.stdout.strip().splitlines()[-1]
    if shutil.which("sbatch") and os.environ.get("LAPHEADS_TEST_PARTITION"):
        return os.environ["LAPHEADS_TEST_PARTITION"]
    pytest.skip(HOW)


@pytest.fixture(autouse=True)
def _threads_restored():
    """The SLURM tests compare with one-thread local runs (a job's threads are its CPUs per task): the suite's
    later tests get their thread count back."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
