"""`python -m nemo_ckpt`: `--help` lists every command with what it does (exit 0); no command or an unknown one
exits 2 with that list; a command runs its module's `main`."""

import subprocess
import sys

from nemo_ckpt.__main__ import COMMANDS, main

NAMES = ("inspect", "consolidate", "verify", "plot", "runs")


def test_help_lists_every_command():
    result = subprocess.run([sys.executable, "-m", "nemo_ckpt", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert set(COMMANDS) == set(NAMES)
    for name in NAMES:
        [line] = [line for line in lines if line.split()[:1] == [name]]
        assert line.split(maxsplit=1)[1] == COMMANDS[name][1]


def test_unknown_or_missing_command_exits_2_with_the_list(capsys):
    assert main(["verfy", "ckpt"]) == 2
    err = capsys.readouterr().err
    assert "error: unknown command 'verfy'" in err and all(f"\n  {name} " in err for name in NAMES)
    assert main([]) == 2
    assert "error: a command is required" in capsys.readouterr().err


def test_a_command_runs_its_modules_main(tmp_path, capsys):
    assert main(["runs", str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"no runs under {tmp_path}\n"
    assert main(["verify", str(tmp_path / "missing")]) == 1
    assert f"{tmp_path / 'missing'} does not exist" in capsys.readouterr().err
