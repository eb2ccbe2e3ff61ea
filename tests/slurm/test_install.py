"""`cluster.sh install` gives up quickly, with one clear reason, where Slurm cannot be installed: without root, or
without a package registry (a network namespace with no network). The Slurm tests then skip with that reason."""

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.slurm.cluster import CLUSTER_SH

FORCE = {**os.environ, "SLURM_FORCE_INSTALL": "1", "SLURM_REGISTRY_TIMEOUT": "20"}


@pytest.fixture
def cluster_sh() -> Path:
    """A copy of cluster.sh that every user can read: the checkout may lie in a private folder (`mktemp -d`)."""
    directory = Path(tempfile.mkdtemp())
    directory.chmod(0o755)
    for name in ("cluster.sh", "netns.sh"):
        shutil.copy(CLUSTER_SH.with_name(name), directory / name)
    yield directory / "cluster.sh"
    shutil.rmtree(directory)


def install(script: Path, *prefix: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    result = subprocess.run(
        [*prefix, "bash", str(script), "install"],
        env=FORCE,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    return result, time.monotonic() - start


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to an unprivileged user needs root")
def test_install_without_root_fails_at_once(cluster_sh):
    result, seconds = install(cluster_sh, "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
    assert result.returncode != 0 and seconds < 10
    assert result.stderr.strip().endswith("Slurm is not installed and installing it needs root")


@pytest.mark.skipif(os.geteuid() != 0, reason="a network namespace needs root")
def test_install_without_registry_fails_within_the_registry_timeout(cluster_sh):
    result, seconds = install(cluster_sh, "unshare", "--net")
    assert result.returncode != 0 and seconds < 45, (seconds, result.stderr[-500:])
    assert "the package registry did not answer within 20s" in result.stderr
