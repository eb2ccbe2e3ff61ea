"""The test-only pause points: off unless named, the n-th reach pauses (marker written, then blocked until killed),
and a wrong setting is an error naming the variable."""

import os
import signal
import time
from pathlib import Path

import pytest

from nemo_ckpt.dist_checkpointing import fault_points
from nemo_ckpt.dist_checkpointing.fault_points import PAUSE_AT, PAUSE_MARKER, pause_point
from tests.helpers import distributed


@pytest.fixture(autouse=True)
def fresh_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fault_points, "_reached", {})


def test_points_do_nothing_unless_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PAUSE_AT, raising=False)
    for point in fault_points.POINTS:
        pause_point(point)
    monkeypatch.setenv(PAUSE_AT, "recover@3")
    for point in fault_points.POINTS:
        pause_point(point)  # each reached once: recover's first reach, the others not named
    assert fault_points._reached == {"recover": 1}


@pytest.mark.parametrize("setting", ["nowhere", "recover@x", "recover@"])
def test_a_wrong_setting_is_an_error(monkeypatch: pytest.MonkeyPatch, setting: str) -> None:
    monkeypatch.setenv(PAUSE_AT, setting)
    with pytest.raises(ValueError, match=PAUSE_AT):
        pause_point("recover")


def test_a_due_point_needs_its_marker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PAUSE_AT, "recover")
    monkeypatch.delenv(PAUSE_MARKER, raising=False)
    with pytest.raises(ValueError, match=PAUSE_MARKER):
        pause_point("recover")


def _reach_twice(marker: str, progress: str) -> None:
    os.environ.update({PAUSE_AT: "recover@2", PAUSE_MARKER: marker})
    pause_point("recover")
    Path(progress).write_text("past the first reach")
    pause_point("recover")
    Path(progress).write_text("past the second reach")


def test_the_nth_reach_writes_the_marker_and_blocks_until_killed(tmp_path: Path) -> None:
    marker, progress = tmp_path / "paused", tmp_path / "progress"
    process = distributed.forkserver().Process(target=_reach_twice, args=(str(marker), str(progress)))
    process.start()
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert process.is_alive() and time.monotonic() < deadline, "the process did not pause"
        time.sleep(0.01)
    assert marker.read_text() == f"recover {process.pid}\n"
    assert progress.read_text() == "past the first reach"
    assert process.is_alive()
    os.kill(process.pid, signal.SIGKILL)
    process.join(30)
    assert process.exitcode == -signal.SIGKILL and progress.read_text() == "past the first reach"
