"""Python side of cluster.sh: start/stop the local Slurm cluster and poll its jobs."""

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

CLUSTER_SH = Path(__file__).with_name("cluster.sh")
TERMINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}


@dataclass(frozen=True)
class SlurmCluster:
    dir: Path
    conf: Path

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` fields of a job the controller still remembers."""
        out = subprocess.run(
            ["scontrol", "show", "job", "--oneliner", job_id], check=True, capture_output=True, text=True
        ).stdout
        return dict(field.split("=", 1) for field in out.split() if "=" in field)

    def wait(self, job_id: str, timeout: float = 90) -> dict[str, str]:
        """Poll until the job reaches a terminal state; return its fields."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info["JobState"] in TERMINAL_STATES:
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {info['JobState']} after {timeout}s: {info}")
            time.sleep(0.5)


def cluster_sh(*args: str, timeout: float) -> subprocess.CompletedProcess:
    """Run `cluster.sh ARGS`, capturing its output."""
    return subprocess.run(
        ["bash", str(CLUSTER_SH), *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )
