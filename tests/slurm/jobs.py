"""The logs of the tests' NeMo-Run Slurm jobs (text and metrics), and the `nemo` command that shows them."""

import csv
import re
from pathlib import Path

from nemo_ckpt.logger.runs import version_dirs
from tests.helpers import commands

REPO = Path(__file__).resolve().parents[2]


def logged_steps(log_dir: Path) -> list[int]:
    """Training steps in the CSV metrics of the latest run (NeMoLogger version)."""
    with open(version_dirs(log_dir / "tiny")[-1] / "metrics.csv") as handle:
        return [int(row["step"]) for row in csv.DictReader(handle) if row["reduced_train_loss"]]


def job_log(job_dir: Path, job_id: str, task: str = "pretrain") -> str:
    """A job's one log (`launch.slurm.JobLog`), every attempt in it."""
    return (job_dir / f"log-nemo_ckpt.{task}_{job_id}.out").read_text()


def node_logs(log: str) -> dict[int, str]:
    """A multi-node job's log (srun `--label`) split by node: `{node: what that node printed}`, the labels and the
    newline before each dropped. srun labels each chunk it reads from a node, and a chunk can end mid-line with the
    other node's output in between: only one node's text is whole (a line srun cut in two is whole again there). Lines
    run together: search it with `in` or a regex, not line by line."""
    pieces = re.split(r"(?:^|\n)(\d+): ", log)
    chunks: dict[int, list[str]] = {}
    for node, text in zip(pieces[1::2], pieces[2::2]):
        chunks.setdefault(int(node), []).append(text)
    return {node: "".join(texts) for node, texts in chunks.items()}


def attempts(log: str, job_id: str) -> dict[int, str]:
    """One node's `log` (`node_logs`) cut at each attempt's first `Slurm job <id>: attempt <n> on`: `{n: its text}`;
    what comes before the first one (torchrun's start) belongs to it. An attempt can be missing: one that ended before
    this node's rank logged its line (the other node failed first), or whose lines were lost with a killed node."""
    starts: dict[int, int] = {}
    for match in re.finditer(rf"Slurm job {job_id}: attempt (\d+) on ", log):
        starts.setdefault(int(match[1]), match.start())
    numbers = sorted(starts, key=starts.get)
    assert numbers == sorted(numbers), f"attempts {numbers} out of order in the log"
    bounds = [0, *(starts[n] for n in numbers[1:]), len(log)]
    return {n: log[begin:end] for n, begin, end in zip(numbers, bounds, bounds[1:])}


def nemo(*args: str) -> str:
    """Run the `nemo` command line (NeMo-Run's, with this package's entry point); its output, which must be a
    success."""
    result = commands.nemo(*args, cwd=REPO, timeout=240)
    assert result.returncode == 0, result.stdout
    return result.stdout
