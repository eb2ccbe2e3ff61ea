"""SIGKILL a 2-rank training run at each named point of its checkpointing, many times in a row (each run resumes the
previous one), with synchronous and with asynchronous saves.

Every kill lands where it is meant to by construction: the ranks start with a pause point armed
(`nemo_ckpt.dist_checkpointing.fault_points`), the test waits until they are paused there (their marker files), then
SIGKILLs both at once or one after the other. The points: mid-save (a rank's first file written, before `.metadata`,
before `metadata.json`, before and after the commit's rename), mid-async-write (the write paused while training goes
on to its next save) and at start-up (mid-restore, mid-recovery), on both ranks or on one. After every kill:

- every visible checkpoint is complete and bit-identical to the uninterrupted run's checkpoint of its step;
- the newest complete checkpoint is the one that had completed (committed) while the ranks were paused: nothing the
  kill interrupted became visible;
- the next run resumes from it: a kill -9 loses exactly the steps since the newest save that had completed; an async
  save in flight at the kill is lost with it (training had gone on past its step);

and the last run, left to finish, ends bit-identical to the uninterrupted run.
"""

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from nemo_ckpt import dist_checkpointing
from nemo_ckpt.checkpoint.layout import LAST_SUFFIX, MANIFEST_NAME, TMP_PREFIX, is_complete, weights_dir
from nemo_ckpt.checkpoint.manifest import CheckpointRecord, Manifest
from nemo_ckpt.dist_checkpointing.fault_points import POINTS
from tests.checkpoint.crash_worker import SAVE_EVERY, rank_main
from tests.helpers import distributed
from tests.helpers.recipe import checkpoint_dir

WORLD_SIZE = 2
MAX_STEPS = 24
TIMEOUT = 600.0  # seconds to reach a point: under a CPU hog an async save's writer (SCHED_IDLE) gets next to no CPU
GRACE = 1.0  # seconds the second rank of a one-after-the-other kill gets to fail on its own before it is killed
STARTUP_POINTS = {"restore-read", "recover"}
ASYNC_WRITER_POINTS = {"distcp-written", "async-write-done"}  # paused in the background writer of an async save


@dataclass(frozen=True)
class Kill:
    """Pause `ranks` at `point` (at the `save`-th save of the run for a save's points), then SIGKILL: both ranks at
    once (`both`), or one (`rank0-first` / `rank1-first`) and, once it is dead, the other."""

    point: str
    ranks: tuple[int, ...]
    save: int = 1
    order: str = "both"


SYNC_KILLS = [
    Kill("distcp-written", (0, 1), save=2),
    Kill("restore-read", (0, 1)),
    Kill("distcp-written", (1,), order="rank1-first"),
    Kill("before-dcp-metadata", (0,), save=2, order="rank0-first"),
    Kill("before-metadata-json", (0,), order="rank1-first"),
    Kill("before-commit-rename", (0,), save=2),
    Kill("recover", (0,)),
    Kill("before-manifest-commit", (0,), order="rank1-first"),
    Kill("restore-read", (1,), order="rank0-first"),
]
ASYNC_KILLS = [
    Kill("distcp-written", (0, 1), save=2),
    Kill("async-write-done", (0, 1), save=2, order="rank0-first"),
    Kill("distcp-written", (0,), order="rank1-first"),
    Kill("async-write-done", (1,), order="rank1-first"),
    Kill("before-dcp-metadata", (0,), save=2),
    Kill("before-metadata-json", (0,), order="rank0-first"),
    Kill("recover", (0,), order="rank1-first"),
    Kill("before-commit-rename", (0,), save=2, order="rank1-first"),
    Kill("before-manifest-commit", (0,)),
    Kill("restore-read", (0, 1)),
]


class Run:
    """A 2-rank training run in `directory`, its ranks forked from the preloaded forkserver; `pause` maps a rank to
    the point (`<point>@<n>`) it pauses at."""

    def __init__(self, directory: Path, tag: str, async_save: bool, save_top_k: int, pause: dict[int, str]) -> None:
        self.progress = directory.parent / f"{directory.name}-{tag}.progress"
        self.logs = [directory.parent / f"{directory.name}-{tag}-rank{rank}.log" for rank in range(WORLD_SIZE)]
        self.markers = {rank: directory.parent / f"{directory.name}-{tag}-rank{rank}.paused" for rank in pause}
        port = distributed.free_port()
        self.processes = [
            distributed.forkserver().Process(
                target=rank_main,
                args=(
                    rank,
                    WORLD_SIZE,
                    port,
                    str(directory),
                    MAX_STEPS,
                    async_save,
                    save_top_k,
                    str(self.progress),
                    str(self.logs[rank]),
                    pause.get(rank),
                    str(self.markers[rank]) if rank in pause else None,
                ),
            )
            for rank in range(WORLD_SIZE)
        ]
        for process in self.processes:
            process.start()

    def events(self) -> list[tuple[str, int]]:
        if not self.progress.exists():
            return []
        return [
            (kind, int(step)) for kind, step in (line.split() for line in self.progress.read_text().split("\n") if line)
        ]

    def _wait(self, done, what: str) -> None:
        deadline = time.monotonic() + TIMEOUT
        while not done():
            if time.monotonic() > deadline or any(not process.is_alive() for process in self.processes):
                self.kill("both")
                raise AssertionError(f"the run stopped or stalled before {what}:\n{self.output()}")
            time.sleep(0.01)

    def wait_paused(self) -> None:
        """Wait until every rank given a point is paused there."""
        self._wait(lambda: all(marker.exists() for marker in self.markers.values()), f"pausing at {self.markers}")

    def wait_for(self, event: tuple[str, int]) -> None:
        """Wait until rank 0 reports `event` (`(kind, step)`)."""
        self._wait(lambda: event in self.events(), str(event))

    def kill(self, order: str) -> None:
        """SIGKILL both ranks at once, or one (`rank0-first` / `rank1-first`) and, once it is dead, the other after it
        had `GRACE` seconds to fail on its own (in its next collective)."""
        first, second = (self.processes[1], self.processes[0]) if order == "rank1-first" else self.processes
        _sigkill(first)
        if order != "both":
            first.join(30)
            second.join(GRACE)
        _sigkill(second)
        for process in self.processes:
            process.join(30)

    def join(self, timeout: float) -> list[int]:
        for process in self.processes:
            process.join(timeout)
        return [process.exitcode for process in self.processes]

    def output(self) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in self.logs if log.exists())


def _sigkill(process) -> None:
    try:
        os.kill(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class Reference:
    """The uninterrupted run's checkpoints, one per save interval, loaded on demand."""

    def __init__(self, directory: Path) -> None:
        self.checkpoints = {record.step: directory / record.name for record in Manifest.read(directory).complete()}
        self._tensors: dict[int, dict[str, torch.Tensor]] = {}

    def tensors(self, step: int) -> dict[str, torch.Tensor]:
        if step not in self._tensors:
            self._tensors[step] = dist_checkpointing.load_plain_tensors(weights_dir(self.checkpoints[step]))
        return self._tensors[step]


@dataclass
class DiskState:
    complete_steps: list[int]
    unfinished_save: bool  # a `.tmp-` checkpoint: the kill interrupted a save before its commit
    saving_steps: list[int]  # steps the manifest records as being saved


def check_disk(directory: Path, reference: Reference) -> DiskState:
    """Every visible entry is the manifest, a complete checkpoint identical to the reference, or a `-last` link
    to one; return what is on disk."""
    if not directory.exists():
        return DiskState([], False, [])
    manifest = Manifest.read(directory)  # parses: never a partial file
    steps = []
    for entry in sorted(directory.iterdir()):
        if entry.name.startswith(".") or entry.name == MANIFEST_NAME:
            continue
        if entry.is_symlink():
            assert entry.name.endswith(LAST_SUFFIX) and is_complete(entry.resolve()), entry
            continue
        assert is_complete(entry), f"{entry} is visible but incomplete"
        step = dist_checkpointing.load_common_state_dict(weights_dir(entry))["global_step"]
        saved = dist_checkpointing.load_plain_tensors(weights_dir(entry))
        expected = reference.tensors(step)
        assert saved.keys() == expected.keys(), entry
        for key in expected:
            assert torch.equal(saved[key], expected[key]), f"{entry}: {key} differs from the uninterrupted run"
        steps.append(step)
    unfinished = any(entry.name.startswith(TMP_PREFIX) and entry.is_dir() for entry in directory.iterdir())
    saving = [record.step for record in manifest.checkpoints if record.state == "saving"]
    return DiskState(sorted(steps), unfinished, saving)


def committed_step(directory: Path) -> int:
    """The step of the newest save that has completed: its directory renamed into place, complete (recorded complete,
    or still `saving` when the kill came between the rename and the manifest update); 0 if none."""
    if not directory.exists():
        return 0
    records = Manifest.read(directory).checkpoints
    return max((r.step for r in records if r.state != "deleting" and is_complete(directory / r.name)), default=0)


def record_of(directory: Path, step: int) -> CheckpointRecord:
    [record] = [record for record in Manifest.read(directory).checkpoints if record.step == step]
    return record


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Reference:
    directory = tmp_path_factory.mktemp("reference")
    run = Run(directory, "uninterrupted", async_save=False, save_top_k=-1, pause={})
    assert run.join(300) == [0, 0], run.output()
    return Reference(checkpoint_dir(directory))


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_sigkill_at_each_checkpoint_point_then_resume(reference, tmp_path, async_save):
    kills = ASYNC_KILLS if async_save else SYNC_KILLS
    assert {kill.point for kill in kills} == POINTS - (set() if async_save else {"async-write-done"}), "every point"
    directory = tmp_path / "run"
    checkpoints = checkpoint_dir(directory)
    newest = 0
    for trial, kill in enumerate(kills):
        saving = kill.point not in STARTUP_POINTS
        in_flight = async_save and kill.point in ASYNC_WRITER_POINTS
        step = newest + SAVE_EVERY * kill.save if saving else newest  # the step of the save the kill interrupts
        assert step + SAVE_EVERY < MAX_STEPS, f"{kill}: the run would reach its end"
        assert kill.point != "restore-read" or newest > 0, f"{kill}: there is no checkpoint to restore yet"
        pause = {rank: f"{kill.point}@{kill.save}" for rank in kill.ranks}
        run = Run(directory, f"trial{trial}", async_save, save_top_k=2, pause=pause)
        run.wait_paused()
        if in_flight:  # training goes on with the save in flight, and waits for it at its next save
            run.wait_for(("step", step + SAVE_EVERY))
        committed = committed_step(checkpoints)
        if saving:  # the kill interrupts the save of `step`: before its commit, or between rename and manifest
            before_rename = kill.point != "before-manifest-commit"
            assert record_of(checkpoints, step).state == "saving", kill
            assert (checkpoints / f"{TMP_PREFIX}{record_of(checkpoints, step).name}").is_dir() == before_rename
            assert committed == (max(newest, step - SAVE_EVERY) if before_rename else step), kill
        else:
            assert committed == newest, kill
        run.kill(kill.order)
        assert all(code != 0 for code in run.join(30)), f"trial {trial} finished training instead of being killed"

        events = run.events()
        starts = [start for kind, start in events if kind == "start"]
        assert (starts == [newest]) if saving else (starts in ([], [newest])), f"trial {trial}: resumed from {starts}"
        reached = max([s for _, s in events], default=newest)
        if in_flight:
            assert reached == step + SAVE_EVERY > step > committed, "training went on past the save in flight"
        disk = check_disk(checkpoints, reference)
        newest = max(disk.complete_steps, default=0)
        assert newest == committed, (
            f"trial {trial} ({kill}): the newest complete checkpoint is {newest}, the newest save that had "
            f"completed before the kill {committed}: {disk}\n{run.output()}"
        )
        # the next run starts at `committed` (asserted next): a kill -9 lost exactly steps committed+1 .. reached

    run = Run(directory, "final", async_save, save_top_k=2, pause={})
    assert run.join(300) == [0, 0], run.output()
    assert [start for kind, start in run.events() if kind == "start"] == [newest]
    disk = check_disk(checkpoints, reference)
    assert disk.complete_steps[-1] == MAX_STEPS and not disk.unfinished_save and not disk.saving_steps
    assert len(disk.complete_steps) <= 3, "top-2 plus -last"
