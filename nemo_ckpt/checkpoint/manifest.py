"""`checkpoints.json`: the record of every checkpoint in a directory, so nothing parses directory names.

A checkpoint's record goes through three states, each written atomically before the file-system change it
announces: `saving` (its data is being written under a temporary name), `complete` (renamed to its name;
loadable), `deleting` (about to be, or being, removed). Records are in the order their saves started, which is
the order they complete (commits run one at a time, in save order), so the newest checkpoint is the last complete
record, whatever its step, or a later `saving` one whose directory is already complete (its commit renamed it,
then the process died before recording it).
"""

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from nemo_ckpt.checkpoint.layout import MANIFEST_NAME, TMP_PREFIX
from nemo_ckpt.dist_checkpointing.core import fsync_path

STATES = ("saving", "complete", "deleting")


@dataclass
class CheckpointRecord:
    """One checkpoint: its directory name, the global step and epoch it holds, and the metrics it was saved with."""

    name: str
    step: int
    epoch: int
    metrics: dict[str, float] = field(default_factory=dict)
    state: str = "saving"
    weights_only: bool = False
    lineage: str | None = None  # the chain of runs that wrote it (a run and the runs resumed from it); None: 0.2

    def __post_init__(self) -> None:
        if self.state not in STATES:
            raise ValueError(f"CheckpointRecord {self.name!r}: state={self.state!r} is not one of {STATES}")


@dataclass
class Manifest:
    """Every checkpoint of a directory, in save order, and which of them `<name>-last` points to."""

    checkpoints: list[CheckpointRecord] = field(default_factory=list)
    last: str | None = None

    @classmethod
    def read(cls, directory: str | Path) -> "Manifest":
        """The manifest of `directory`; an empty one if there is none."""
        path = Path(directory) / MANIFEST_NAME
        if not path.exists():
            return cls()
        try:
            raw = json.loads(path.read_text())
            return cls([CheckpointRecord(**record) for record in raw["checkpoints"]], raw.get("last"))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{path} is not a valid checkpoint manifest ({error}); fix or remove it") from error

    def write(self, directory: str | Path) -> None:
        """Replace the manifest atomically and durably: readers see the old or the new file, never a partial one."""
        path = Path(directory) / MANIFEST_NAME
        tmp = path.with_name(f"{TMP_PREFIX}{MANIFEST_NAME}")
        payload = json.dumps({"checkpoints": [asdict(r) for r in self.checkpoints], "last": self.last}, indent=1)
        try:
            with open(tmp, "w") as handle:
                handle.write(payload)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_path(path.parent)

    def get(self, name: str) -> CheckpointRecord | None:
        return next((record for record in self.checkpoints if record.name == name), None)

    def add(self, record: CheckpointRecord) -> None:
        """Append `record`, replacing any record of the same name."""
        self.checkpoints = [r for r in self.checkpoints if r.name != record.name] + [record]

    def update(self, record: CheckpointRecord) -> None:
        """Replace the record of the same name where it is (append `record` if there is none)."""
        names = [r.name for r in self.checkpoints]
        if record.name in names:
            self.checkpoints[names.index(record.name)] = record
        else:
            self.checkpoints.append(record)

    def remove(self, name: str) -> None:
        self.checkpoints = [r for r in self.checkpoints if r.name != name]

    def complete(self) -> list[CheckpointRecord]:
        """Complete checkpoints, oldest first."""
        return [record for record in self.checkpoints if record.state == "complete"]

    def newest(self) -> CheckpointRecord | None:
        """The last complete checkpoint."""
        complete = self.complete()
        return complete[-1] if complete else None
