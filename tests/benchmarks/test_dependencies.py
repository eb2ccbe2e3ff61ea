"""Every benchmark script checks its dependencies at start: a missing one stops it at once with the install
command, and a missing optional peer (megatron-core) is named and left out."""

import runpy
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = ["ckpt_bench.py", "data_bench.py", "step_bench.py", "tp_bench.py", "checksum_bench.py", "moe_bench.py"]
SCRIPTS += ["disk_ceiling.py", "train_ckpt_bench.py"]
SCRIPTS += ["cp_bench.py", "pp_bench.py"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_starts_and_shows_its_options(script, monkeypatch, capsys):
    """`python benchmarks/<script> --help`, run in this interpreter (torch already imported: seconds saved per
    script)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setattr(sys, "argv", [str(BENCHMARKS / script), "--help"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(BENCHMARKS / script), run_name="__main__")
    output = capsys.readouterr()
    assert exit_.value.code == 0, output.err
    assert "usage:" in output.out


def test_missing_dependency_exits_naming_the_install_command(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setattr(sys, "argv", ["ckpt_bench.py"])
    import results

    with pytest.raises(SystemExit, match=r"ckpt_bench.py needs not_a_module_xyz: pip install .*'\.\[bench\]'"):
        results.check_dependencies(["not_a_module_xyz"])
    with pytest.raises(SystemExit, match=r"ckpt_bench.py needs the program\(s\) not_a_program_xyz on PATH"):
        results.check_dependencies([], programs=["not_a_program_xyz"])
    results.check_dependencies([], {"not_a_peer_xyz": "pip install not-a-peer"}, programs=["dd"])
    assert "not_a_peer_xyz is not importable, so it is left out of the comparison (pip install not-a-peer)" in (
        capsys.readouterr().out
    )
