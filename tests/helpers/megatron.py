"""The megatron-core versions the interop tests run against, each installed by `tests/install_megatron_core.sh`
into `<venv>/megatron-core-<version>` (without dependencies: megatron-core pins other torch and Python versions)."""

import importlib
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
IN_PROCESS_VERSION = "0.19.2"


def megatron_core_sites() -> dict[str, Path]:
    """version -> the directory holding that version's `megatron` package."""
    sites = sorted(Path(sys.prefix).glob("megatron-core-*"))
    return {site.name.removeprefix("megatron-core-"): site for site in sites if (site / "megatron/core").is_dir()}


def import_megatron_on_cpu(module: str) -> ModuleType:
    """Import a megatron-core module with its CUDA calls shimmed for CPU (its checkpoint code synchronizes CUDA;
    0.15 calls `numpy.product`, removed in numpy 2). In test processes only."""
    import numpy
    import torch

    numpy.product = numpy.prod
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *args, **kwargs: None
        torch.cuda.current_device = lambda: "cpu"
    return importlib.import_module(module)


def importorskip_megatron_core(module: str) -> ModuleType:
    """`module` of megatron-core 0.19.2 in this process (its directory put on `sys.path`, which the test's spawned
    ranks inherit); skip the test module when it is not installed."""
    site = megatron_core_sites().get(IN_PROCESS_VERSION)
    if site is not None and str(site) not in sys.path:
        sys.path.append(str(site))
    pytest.importorskip(module, reason=f"megatron-core {IN_PROCESS_VERSION}: run tests/install_megatron_core.sh")
    return import_megatron_on_cpu(module)


def torchrun(nproc: int, script: Path, *args: str, site: Path | None = None) -> subprocess.CompletedProcess:
    """Run `script` on `nproc` local ranks, with `site` (one megatron-core version) first on PYTHONPATH; raise with
    the ranks' output when it fails."""
    path = [str(site)] if site else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*path, str(REPO)]), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(script)]
    result = subprocess.run([*command, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    failure = f"{' '.join(args)} on {nproc} ranks failed:\n{result.stdout}\n{result.stderr[-6000:]}"
    assert result.returncode == 0, failure
    return result
