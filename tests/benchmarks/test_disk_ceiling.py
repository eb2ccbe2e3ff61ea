"""The disk ceiling's writes: the requested bytes, durably, as copies of an in-memory source of pseudo-random
bytes (never zeros, which a virtual disk may skip), in parallel `dd` streams that cover more than the source;
started in the background at the lowest CPU priority where asked, and a failed stream an error naming it."""

import os
import shutil
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

pytestmark = pytest.mark.skipif(shutil.which("dd") is None, reason="needs dd")


@pytest.fixture
def disk_ceiling(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import disk_ceiling

    monkeypatch.setattr(disk_ceiling, "SOURCE_BYTES", 1 << 20)
    monkeypatch.setattr(disk_ceiling, "SOURCE_BLOCK", 256 << 10)
    monkeypatch.setattr(disk_ceiling, "DIRECT_BLOCK_MIB", 1)
    return disk_ceiling


def opens_direct(directory: Path) -> bool:
    try:
        os.close(os.open(directory / "probe", os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0)))
    except OSError:
        return False
    os.unlink(directory / "probe")
    return hasattr(os, "O_DIRECT")


@pytest.mark.parametrize("direct", [False, True])
def test_streams_write_copies_of_the_source(tmp_path, disk_ceiling, direct):
    if direct and not opens_direct(tmp_path):
        pytest.skip(f"no O_DIRECT on the file system of {tmp_path}")
    source = disk_ceiling.source_file(16 << 20)
    try:
        data = source.read_bytes()
        assert len(data) == 1 << 20 and data.count(0) < len(data) // 128  # pseudo-random, not zeros
        assert data[: 256 << 10] * 4 == data
        disk_ceiling.write(tmp_path, source, 4 << 20, streams=2, direct=direct, prefix="r0_")
    finally:
        source.unlink()
    files = disk_ceiling.stream_files(tmp_path, 2, "r0_direct_" if direct else "r0_")
    assert sorted(tmp_path.iterdir()) == files
    assert all(path.read_bytes() == data * 2 for path in files)


def test_background_writers_run_at_idle_priority_and_failures_raise(tmp_path, disk_ceiling):
    probe = "import os, sys; open(sys.argv[1], 'w').write(str(os.sched_getscheduler(0)))"
    disk_ceiling.wait(disk_ceiling.start([[sys.executable, "-c", probe, str(tmp_path / "policy")]], idle=True))
    assert int((tmp_path / "policy").read_text()) == os.SCHED_IDLE
    with pytest.raises(RuntimeError, match="dd failed .*missing_source"):
        disk_ceiling.wait(disk_ceiling.start([["dd", f"if={tmp_path / 'missing_source'}", "of=/dev/null"]]))
