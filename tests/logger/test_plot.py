"""`plot_run` and `python -m nemo_ckpt plot` on a run resumed twice (three versions, one curve)."""

import pytest

from nemo_ckpt.logger import NeMoLogger
from nemo_ckpt.logger.cli import main
from nemo_ckpt.logger.plot import plot_run
from nemo_ckpt.logger.runs import find_runs, read_scalars, version_dirs
from tests.logger.tiny import fit, trainer

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def resumed_twice(tmp_path_factory):
    """`<log_dir>/exp` of a run to step 3, resumed to 5, resumed to 7 (Lightning checkpoints, NeMoLogger logs)."""
    root = tmp_path_factory.mktemp("plot")
    checkpoint = None
    for max_steps in (3, 5, 7):
        run = trainer(max_steps=max_steps)
        NeMoLogger(name="exp", log_dir=str(root)).setup(run)
        fit(run, checkpoint)
        checkpoint = root / f"step{max_steps}.ckpt"
        run.save_checkpoint(checkpoint)
    return root / "exp"


def test_plot_of_a_run_resumed_twice_is_one_continuous_curve(resumed_twice, tmp_path):
    versions = version_dirs(resumed_twice)
    assert len(versions) == 3
    out, data = plot_run(resumed_twice, ["reduced_train_loss", "lr", "not_logged"], tmp_path / "curves.png")
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    assert set(data) == {"reduced_train_loss", "lr"}, "metrics the run did not log are left out"
    assert list(data["reduced_train_loss"]) == list(range(7))
    per_version = [read_scalars(version)["reduced_train_loss"] for version in versions]
    assert [sorted(steps) for steps in per_version] == [[0, 1, 2], [3, 4], [5, 6]]
    assert data["reduced_train_loss"] == per_version[0] | per_version[1] | per_version[2]


def test_plot_command_and_its_errors(resumed_twice, tmp_path, capsys):
    assert main(["plot", str(resumed_twice)]) == 0
    assert (resumed_twice / "curves.png").read_bytes()[:8] == PNG_SIGNATURE
    assert "reduced_train_loss: 7 points, steps 0-6" in capsys.readouterr().out
    assert main(["plot", str(resumed_twice), "--metrics", "nothing"]) == 1
    assert "logged none of ['nothing']" in capsys.readouterr().err
    assert main(["plot", str(tmp_path)]) == 1
    assert "holds no logs" in capsys.readouterr().err


def test_runs_lists_the_versions(resumed_twice, capsys):
    [run] = find_runs(resumed_twice.parent)
    assert run.name == "exp" and run.last_step == 6 and run.last_checkpoint is None
    assert [(v.first_step, v.last_step) for v in run.versions] == [(0, 2), (3, 4), (5, 6)]
    assert main(["runs", str(resumed_twice.parent)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"exp ({resumed_twice}): 3 version(s), last logged step 6, last checkpoint none"
    assert [line.split(": ")[1] for line in lines[1:]] == ["steps 0-2", "steps 3-4", "steps 5-6"]
