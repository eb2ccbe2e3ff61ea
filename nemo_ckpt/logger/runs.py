"""Read what `NeMoLogger` left on disk: the runs under a log directory, their versions, and the logged scalars of
all versions of a run joined along the step axis (a resumed run reads as one)."""

import csv
import re
from dataclasses import dataclass
from pathlib import Path

from nemo_ckpt.checkpoint.manifest import Manifest

CHECKPOINTS = "checkpoints"
EVENTS_GLOB = "events.out.tfevents.*"
CSV_NAME = "metrics.csv"


@dataclass
class Version:
    """One run of an experiment: its log directory and the steps it logged."""

    path: Path
    first_step: int | None
    last_step: int | None

    @property
    def name(self) -> str:
        return self.path.name


@dataclass
class Run:
    """An experiment directory (`<log_dir>/<name>`): its versions, oldest first, and its newest checkpoint."""

    path: Path
    versions: list[Version]
    last_checkpoint: str | None

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def last_step(self) -> int | None:
        steps = [version.last_step for version in self.versions if version.last_step is not None]
        return max(steps) if steps else None


def _natural_key(path: Path) -> list[int | str]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.name)]


def csv_files(version_dir: Path) -> list[Path]:
    """A version's metrics CSV files, oldest first: `metrics.csv`, then `metrics_<k>/metrics.csv` of runs that
    reused its directory."""
    return sorted([*version_dir.glob(CSV_NAME), *version_dir.glob(f"metrics_*/{CSV_NAME}")], key=_natural_key_of_parent)


def _natural_key_of_parent(path: Path) -> list[int | str]:
    return _natural_key(path.parent)


def is_version_dir(path: Path) -> bool:
    """Whether `path` holds a run's logs (TensorBoard events or a metrics CSV)."""
    return path.is_dir() and (any(path.glob(EVENTS_GLOB)) or bool(csv_files(path)))


def version_dirs(run_dir: Path) -> list[Path]:
    """The log directories of the runs of `run_dir`, oldest first (version names are start times or numbers);
    `run_dir` itself when it holds logs directly (`explicit_log_dir`)."""
    run_dir = Path(run_dir)
    if is_version_dir(run_dir):
        return [run_dir]
    children = [path for path in run_dir.iterdir() if path.name != CHECKPOINTS and is_version_dir(path)]
    return sorted(children, key=_natural_key)


def read_scalars(version_dir: Path) -> dict[str, dict[int, float]]:
    """Every scalar a version logged, `{tag: {step: value}}`: from its TensorBoard events (read with
    tensorboard's event reader) or, without events, from its metrics CSV files."""
    version_dir = Path(version_dir)
    if any(version_dir.glob(EVENTS_GLOB)):
        from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

        events = EventAccumulator(str(version_dir), size_guidance={SCALARS: 0})
        events.Reload()
        return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()[SCALARS]}
    scalars: dict[str, dict[int, float]] = {}
    for path in csv_files(version_dir):
        with open(path, newline="") as handle:
            for row in csv.DictReader(handle):
                step = int(row.pop("step"))
                for tag, value in row.items():
                    if value != "":
                        scalars.setdefault(tag, {})[step] = float(value)
    return scalars


def join(versions: list[dict[str, dict[int, float]]]) -> dict[str, dict[int, float]]:
    """Scalars of successive versions (oldest first) on one step axis, sorted by step; where versions overlap (a
    run that crashed after its last checkpoint, then resumed from it), the newer one wins."""
    joined: dict[str, dict[int, float]] = {}
    for scalars in versions:
        for tag, values in scalars.items():
            joined.setdefault(tag, {}).update(values)
    return {tag: dict(sorted(values.items())) for tag, values in joined.items()}


def joined_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """The scalars of every version of `run_dir` on one step axis, `{tag: {step: value}}` (see `join`)."""
    return join([read_scalars(version_dir) for version_dir in version_dirs(run_dir)])


def describe_run(run_dir: Path) -> Run:
    """A run's versions with the steps each logged (`reduced_train_loss`, else any scalar) and its newest
    checkpoint (from `checkpoints/checkpoints.json`)."""
    run_dir = Path(run_dir)
    versions = []
    for version_dir in version_dirs(run_dir):
        scalars = read_scalars(version_dir)
        steps = scalars.get("reduced_train_loss") or {step: 0.0 for values in scalars.values() for step in values}
        versions.append(Version(version_dir, min(steps, default=None), max(steps, default=None)))
    manifest = Manifest.read(run_dir / CHECKPOINTS)
    complete = [record.name for record in manifest.checkpoints if record.state == "complete"]
    return Run(run_dir, versions, manifest.last or (complete[-1] if complete else None))


def find_runs(log_dir: Path) -> list[Run]:
    """The runs under `log_dir` (its sub-directories with logs or checkpoints), or `log_dir` itself if it is one."""
    log_dir = Path(log_dir)
    if not log_dir.is_dir():
        raise FileNotFoundError(f"{log_dir} is not a directory; give NeMoLogger's log_dir (or <log_dir>/<name>)")

    def is_run(path: Path) -> bool:
        return (path / CHECKPOINTS).is_dir() or is_version_dir(path) or any(map(is_version_dir, path.iterdir()))

    if is_run(log_dir):
        return [describe_run(log_dir)]
    return [
        describe_run(path) for path in sorted(log_dir.iterdir(), key=_natural_key) if path.is_dir() and is_run(path)
    ]
