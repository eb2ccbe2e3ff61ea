"""Real Slurm clusters for the tests in this directory (see cluster.sh): one node, and two nodes."""

import io
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import nemo_run.config
import pytest
from nemo_run.run.torchx_backend.schedulers import slurm as slurm_scheduler

from tests.slurm.cluster import SlurmCluster, cluster_sh


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """Start munged/slurmctld/slurmd in a tmp dir (installing Slurm via apt if needed)."""
    try:
        install = cluster_sh("install", timeout=900)
    except subprocess.TimeoutExpired:
        pytest.skip("Slurm is not installed and installing it took over 900 s")
    if install.returncode != 0:
        reason = install.stderr.strip().splitlines()[-1] if install.stderr.strip() else "no output"
        pytest.skip(f"Slurm is not installed and cannot be installed: {reason}")
    cluster_dir = tmp_path_factory.mktemp("slurm")
    start = cluster_sh("start", str(cluster_dir), timeout=180)
    conf = cluster_dir / "slurm.conf"
    old_conf = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(conf)
    try:
        assert start.returncode == 0, f"cluster.sh start failed:\n{start.stdout}\n{start.stderr}"
        assert start.stdout.strip().endswith(f"export SLURM_CONF={conf}")
        yield SlurmCluster(dir=cluster_dir, conf=conf)
    finally:
        cluster_sh("stop", str(cluster_dir), timeout=120)
        if old_conf is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old_conf


@pytest.fixture
def nemorun_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Keep NeMo-Run's experiments and its Slurm job registry inside tmp_path.

    Also gives NeMo-Run's `invoke` calls (sbatch) a readable stdin: pytest's stdin raises.
    `NEMORUN_HOME` is set too, for `nemo` commands run in subprocesses.
    """
    monkeypatch.setattr(sys, "stdin", io.StringIO())
    home = tmp_path / "home"
    monkeypatch.setattr(nemo_run.config, "_NEMORUN_HOME", str(home))
    monkeypatch.setattr(slurm_scheduler, "SLURM_JOB_DIRS", str(home / ".slurm_jobs"))
    monkeypatch.setenv("NEMORUN_HOME", str(home))
    return home


@pytest.fixture(scope="session")
def _two_node_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """Two compute nodes (node0, node1), each slurmd in its own network namespace (cluster.sh start DIR 2)."""
    if os.geteuid() != 0:
        pytest.skip("a two-node cluster on one machine needs root (network namespaces)")
    install = cluster_sh("install", timeout=900)
    if install.returncode != 0:
        pytest.skip(f"Slurm is not installed and cannot be installed: {install.stderr.strip()[-300:]}")
    cluster_dir = tmp_path_factory.mktemp("slurm2")
    start = cluster_sh("start", str(cluster_dir), "2", timeout=180)
    try:
        assert start.returncode == 0, f"cluster.sh start failed:\n{start.stdout}\n{start.stderr}"
        yield SlurmCluster(dir=cluster_dir, conf=cluster_dir / "slurm.conf")
    finally:
        cluster_sh("stop", str(cluster_dir), timeout=120)


@pytest.fixture
def two_node_cluster(_two_node_cluster: SlurmCluster, monkeypatch: pytest.MonkeyPatch) -> SlurmCluster:
    """The two-node cluster, as `SLURM_CONF` for this test only (the one-node cluster may run beside it)."""
    monkeypatch.setenv("SLURM_CONF", str(_two_node_cluster.conf))
    return _two_node_cluster
