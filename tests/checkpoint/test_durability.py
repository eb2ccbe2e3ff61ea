"""Durability: before the rename that commits a checkpoint, every file of the save (data, `.metadata`,
`metadata.json`, `common.pt`, `context/*`) and every directory of it was fsynced; the manifest too before its
rename. Checked on the system calls of a real save, traced with `strace -f`."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_ckpt.checkpoint.layout import MANIFEST_NAME, TMP_PREFIX

REPO = Path(__file__).resolve().parents[2]
SYSCALL = re.compile(r'^(\d+) +(?:(fsync)\(\d+<([^>]*)>(.*)|(rename)\("([^"]*)", "([^"]*)"\)|<\.\.\. (fsync) resumed>)')


def completed_calls(trace: str) -> list[tuple[str, str, str | None]]:
    """(call, path, target) in the order the calls completed; an fsync split over two lines (threads) completes
    at its `resumed` line."""
    calls, pending = [], {}
    for line in trace.splitlines():
        match = SYSCALL.match(line)
        if not match:
            continue
        pid = match.group(1)
        if match.group(2):
            if "<unfinished" in match.group(4):
                pending[pid] = match.group(3)
            elif match.group(4).startswith(")") and match.group(4).strip().endswith("= 0"):
                calls.append(("fsync", match.group(3), None))
        elif match.group(5):
            calls.append(("rename", match.group(6), match.group(7)))
        elif pid in pending:
            calls.append(("fsync", pending.pop(pid), None))
    return calls


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed (apt-get install strace)")
def test_every_file_and_directory_is_fsynced_before_the_commit_rename(tmp_path):
    script = f"import sys; sys.path.insert(0, {str(REPO)!r}); from tests.helpers.recipe import train; "
    script += f"train({str(tmp_path / 'run')!r}, 2, 1, every_n_train_steps=2)"
    trace_file = tmp_path / "trace.txt"
    command = ["strace", "-f", "-qq", "-y", "-e", "trace=fsync,rename", "-o", str(trace_file), sys.executable]
    done = subprocess.run([*command, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    calls = completed_calls(trace_file.read_text())

    checkpoints = tmp_path / "run" / "tiny" / "checkpoints"
    [final] = [p for p in checkpoints.iterdir() if p.is_dir() and not p.is_symlink()]
    tmp = checkpoints / f"{TMP_PREFIX}{final.name}"
    [commit] = [
        i for i, (call, src, dst) in enumerate(calls) if call == "rename" and (src, dst) == (str(tmp), str(final))
    ]
    synced_before = {path for call, path, _ in calls[:commit] if call == "fsync"}

    files = sorted(p.relative_to(final) for p in final.rglob("*") if p.is_file())
    assert {"weights/.metadata", "weights/metadata.json", "weights/common.pt", "context/model.json"} <= set(
        map(str, files)
    ) and any(p.suffix == ".distcp" for p in files)
    for relative in files:  # written in place, or as `<name>.tmp` then renamed
        assert {str(tmp / relative), f"{tmp / relative}.tmp"} & synced_before, (
            f"{relative} not fsynced before commit:\n{trace_file.read_text()[-6000:]}"
        )
    for directory in (tmp, tmp / "weights", tmp / "context"):
        assert str(directory) in synced_before, f"directory {directory} not fsynced before commit"

    manifest_renames = [
        i for i, (call, _, dst) in enumerate(calls) if call == "rename" and dst == str(checkpoints / MANIFEST_NAME)
    ]
    for index in manifest_renames:
        assert ("fsync", str(checkpoints / f"{TMP_PREFIX}{MANIFEST_NAME}"), None) in calls[:index]
        assert ("fsync", str(checkpoints), None) in calls[index:]
    assert max(manifest_renames) > commit  # the manifest records the commit after it
