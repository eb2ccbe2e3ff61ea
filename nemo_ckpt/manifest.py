"""`checkpoints.json`: the record of every checkpoint in a directory, so nothing parses directory names."""

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

MANIFEST_NAME = "checkpoints.json"


@dataclass
class CheckpointRecord:
    name: str
    step: int
    epoch: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Manifest:
    """Complete checkpoints, oldest first, and which of them is `-last`."""

    checkpoints: list[CheckpointRecord] = field(default_factory=list)
    last: str | None = None

    @classmethod
    def read(cls, directory: str | Path) -> "Manifest":
        path = Path(directory) / MANIFEST_NAME
        if not path.exists():
            return cls()
        try:
            raw = json.loads(path.read_text())
            return cls([CheckpointRecord(**record) for record in raw["checkpoints"]], raw.get("last"))
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(f"{path} is not a valid checkpoint manifest ({error}); fix or remove it") from error

    def write(self, directory: str | Path) -> None:
        """Replace the manifest atomically: readers see the old or the new file, never a partial one."""
        path = Path(directory) / MANIFEST_NAME
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"checkpoints": [asdict(r) for r in self.checkpoints], "last": self.last}, indent=1))
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)

    def newest(self) -> CheckpointRecord | None:
        return max(self.checkpoints, key=lambda record: record.step, default=None)
