"""SIGKILL a 2-rank training run at random moments, many times in a row (each run resumes the previous one), with
synchronous and with asynchronous saves; after every kill:

- every visible checkpoint is complete and bit-identical to the uninterrupted run's checkpoint of its step;
- at most one save interval (plus the one async save in flight) of progress is lost;
- the next run resumes from the newest complete checkpoint;

and the last run, left to finish, ends bit-identical to the uninterrupted run. Kills land at random times
after start-up, right after a save began (mid-save) or once the next batch ran (mid-async-write), and during
start-up (mid-restore, mid-recovery), on both ranks at once or one after the other. Every random choice is
valid by construction: a trial never waits for a step past `MAX_STEPS - MARGIN`, and once the newest checkpoint is
that close to the end, trials are killed during start-up, so no trial can finish training before its kill.
"""

import os
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from nemo_ckpt import dist_checkpointing
from nemo_ckpt.checkpoint.layout import LAST_SUFFIX, MANIFEST_NAME, TMP_PREFIX, is_complete, weights_dir
from nemo_ckpt.checkpoint.manifest import Manifest
from tests.checkpoint.crash_worker import SAVE_EVERY, rank_main
from tests.helpers import distributed
from tests.helpers.recipe import checkpoint_dir

WORLD_SIZE = 2
MAX_STEPS = 100
TRIALS = 12  # per mode: 24 kills in all
MARGIN = 10  # steps kept between any step a trial waits for and MAX_STEPS
SEED = int(os.environ.get("CRASH_TEST_SEED", "0"))


class Run:
    """A 2-rank training run in `directory`, its ranks forked from the preloaded forkserver."""

    def __init__(self, directory: Path, tag: str, async_save: bool, save_top_k: int) -> None:
        self.progress = directory.parent / f"{directory.name}-{tag}.progress"
        self.logs = [directory.parent / f"{directory.name}-{tag}-rank{rank}.log" for rank in range(WORLD_SIZE)]
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

    def wait_for(self, event: tuple[str, int] | str, timeout: float = 60.0) -> None:
        """Wait until rank 0 reports `event` (`(kind, step)`, or just a kind)."""
        deadline = time.monotonic() + timeout
        while not any(event in (kind, (kind, step)) for kind, step in self.events()):
            if time.monotonic() > deadline or any(not process.is_alive() for process in self.processes):
                self.kill("both", 0.0)
                raise AssertionError(f"the run stopped or stalled before {event}:\n{self.output()}")
            time.sleep(0.002)

    def wait_at_most(self, seconds: float, last_step: int) -> None:
        """Sleep `seconds`, or less: until rank 0 reports a step at or past `last_step` (or the run ends)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and all(process.is_alive() for process in self.processes):
            if any(step >= last_step for _, step in self.events()):
                return
            time.sleep(0.002)

    def kill(self, order: str, gap: float) -> None:
        """SIGKILL both ranks at once, or one (`rank0-first` / `rank1-first`) and the other `gap` seconds later."""
        first, second = (self.processes[1], self.processes[0]) if order == "rank1-first" else self.processes
        _sigkill(first)
        if order != "both":
            time.sleep(gap)
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


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Reference:
    directory = tmp_path_factory.mktemp("reference")
    run = Run(directory, "uninterrupted", async_save=False, save_top_k=-1)
    assert run.join(300) == [0, 0], run.output()
    return Reference(checkpoint_dir(directory))


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_sigkill_at_random_moments_then_resume(reference, tmp_path, async_save):
    rng = random.Random(SEED * 2 + async_save)
    directory = tmp_path / "run"
    checkpoints = checkpoint_dir(directory)
    # a kill loses the steps since the newest commit: one interval, plus the async save still being written
    max_lost = SAVE_EVERY * (2 if async_save else 1)
    newest, interrupted_saves, interrupted_async_writes, resumes_checked = 0, 0, 0, 0
    for trial in range(TRIALS):
        run = Run(directory, f"trial{trial}", async_save, save_top_k=2)
        near_the_end = newest >= MAX_STEPS - MARGIN - 3 * SAVE_EVERY
        last_step = newest if near_the_end else MAX_STEPS - MARGIN  # near the end: killed by the time training starts
        plan = "startup" if near_the_end else rng.choice(["startup", "random", "save", "save"])
        if plan == "startup":
            run.wait_at_most(rng.uniform(0.0, 1.0), last_step)
        else:
            run.wait_for("start")
            if plan == "random":
                run.wait_at_most(rng.uniform(0.0, 0.3), last_step)
            else:
                save_step = run.events()[0][1] + SAVE_EVERY * rng.randint(1, 3)
                # right after the step (its save starting) or once the next batch runs (an async save in flight)
                run.wait_for((rng.choice(["step", "batch"]), save_step))
                time.sleep(rng.uniform(0.0, 0.04))
        run.kill(rng.choice(["both", "rank0-first", "rank1-first"]), rng.uniform(0.0, 0.05))
        assert all(code != 0 for code in run.join(30)), f"trial {trial} finished training instead of being killed"

        events = run.events()
        starts = [step for kind, step in events if kind == "start"]
        if starts:
            assert starts == [newest], f"trial {trial} resumed from step {starts}, the newest complete is {newest}"
            resumes_checked += 1
        reached = max([step for _, step in events], default=newest)
        disk = check_disk(checkpoints, reference)
        newest = max(disk.complete_steps, default=0)
        assert reached - newest <= max_lost, (
            f"trial {trial} ({plan}) reached step {reached} but the newest "
            f"complete checkpoint is {newest}: {disk}\n{run.output()}"
        )
        interrupted_saves += disk.unfinished_save
        interrupted_async_writes += disk.unfinished_save and any(
            ("batch", step) in events for step in disk.saving_steps
        )

    assert interrupted_saves >= 1, "no kill landed in the middle of a save"
    if async_save:
        assert interrupted_async_writes >= 1, "no kill landed while training went on with an async save in flight"
    assert resumes_checked >= TRIALS // 2

    run = Run(directory, "final", async_save, save_top_k=2)
    assert run.join(300) == [0, 0], run.output()
    assert [step for kind, step in run.events() if kind == "start"] == [newest]
    disk = check_disk(checkpoints, reference)
    assert disk.complete_steps[-1] == MAX_STEPS and not disk.unfinished_save and not disk.saving_steps
    assert len(disk.complete_steps) <= 3, "top-2 plus -last"
