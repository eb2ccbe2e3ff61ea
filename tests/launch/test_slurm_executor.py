"""launch.slurm.slurm_executor: the sbatch script NeMo-Run generates from it, and validation."""

import io
import socket
import sys
from pathlib import Path

import nemo_run as run
import pytest
from nemo_run.cli.api import RunContext

from launch.slurm import check_submittable, sbatch_options, slurm_executor

QUIET = {"LOGLEVEL": "WARNING", "OMP_NUM_THREADS": "1"}  # launcher_env() where the shell sets neither


@pytest.fixture(autouse=True)
def readable_stdin(monkeypatch: pytest.MonkeyPatch) -> None:
    """NeMo-Run shells out through `invoke`, which reads stdin; pytest's stdin raises. torchrun's env vars unset."""
    monkeypatch.setattr(sys, "stdin", io.StringIO())
    monkeypatch.delenv("LOGLEVEL", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


def sbatch_script(executor: run.SlurmExecutor, base_dir: Path, name: str = "job") -> str:
    """The sbatch script NeMo-Run writes for a dummy task, without submitting it."""
    with run.Experiment("unit", executor=executor, base_dir=str(base_dir), log_level="WARN") as exp:
        exp.add(run.Script(inline="echo hello"), name=name)
        exp.dryrun(log=False, delete_exp_dir=False)
    (path,) = base_dir.glob(f"experiments/unit/*/{name}_sbatch.sh")
    return path.read_text()


def sbatch_lines(script: str) -> list[str]:
    return [line for line in script.splitlines() if line.startswith("#SBATCH")]


def srun_line(script: str) -> str:
    (line,) = [line for line in script.splitlines() if line.startswith("srun --output")]
    return line


def test_multi_node_gpu_container_job(tmp_path: Path) -> None:
    executor = slurm_executor(
        account="proj_llm",
        partition="batch",
        nodes=2,
        ntasks_per_node=4,
        gpus_per_node=4,
        time="04:00:00",
        container_image="nvcr.io/nvidia/pytorch:24.05-py3",
        container_mounts=["/lustre/data:/data", "/lustre/ckpt:/ckpt:rw"],
        env_vars={"NCCL_DEBUG": "WARN", "DATA": "/data"},
        signal="USR1@90",
        job_dir=str(tmp_path / "experiments"),
    )

    script = sbatch_script(executor, tmp_path)

    (job_dir,) = (tmp_path / "experiments" / "unit").glob("*/job")
    assert "# Run with: sbatch --requeue --parsable" in script
    assert sbatch_lines(script) == [
        "#SBATCH --account=proj_llm",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --job-name=nemo_ckpt.job",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={job_dir}/sbatch_nemo_ckpt.job_%j.out",
        "#SBATCH --partition=batch",
        "#SBATCH --signal=USR1@90",
        "#SBATCH --time=04:00:00",
    ]
    assert (
        "export LOGLEVEL=WARNING\nexport OMP_NUM_THREADS=1\n"
        "export PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1\nexport TORCH_ELASTIC_SHUTDOWN_TIMEOUT=90\n"
        "export NCCL_DEBUG=WARN\nexport DATA=/data\n"
    ) in script
    srun = srun_line(script)
    assert (
        "--container-image nvcr.io/nvidia/pytorch:24.05-py3 "
        f"--container-mounts /lustre/data:/data,/lustre/ckpt:/ckpt:rw,{job_dir}:/nemo_run "
        "--container-workdir /nemo_run/code"
    ) in srun
    assert "torchrun --rdzv-backend c10d --rdzv-endpoint $head_node_ip:29500" in srun
    assert "--nnodes 2 --nproc-per-node 4 --node-rank $SLURM_NODEID" in srun
    assert "--kill-on-bad-exit=1 --open-mode=append --label torchrun" in srun, (
        "a failed rank ends the step; log lines name their node"
    )
    assert srun.endswith("--no-python /nemo_run/scripts/job.sh")


def test_single_node_cpu_job_without_account_or_container(tmp_path: Path) -> None:
    executor = slurm_executor(
        ntasks_per_node=2,
        retries=2,
        job_dir=str(tmp_path / "experiments"),
        additional_parameters={"exclusive": True, "mail_type": "END"},
    )

    script = sbatch_script(executor, tmp_path)

    (job_dir,) = (tmp_path / "experiments" / "unit").glob("*/job")
    flags = sbatch_lines(script)
    assert "#SBATCH --exclusive" in flags and "#SBATCH --mail-type=END" in flags
    assert "#SBATCH --time=00:30:00" in flags
    assert not [
        f for f in flags if f.split("=")[0] in ("#SBATCH --account", "#SBATCH --partition", "#SBATCH --gpus-per-node")
    ]
    assert "export TORCHX_MAX_RETRIES=2" in script
    srun = srun_line(script)
    assert f"--chdir {job_dir}/code" in srun and "--container-image" not in srun
    assert "--rdzv-endpoint localhost:0" in srun and "--nnodes 1 --nproc-per-node 2 --node-rank 0" in srun
    assert "--label" not in srun
    assert srun.endswith(f"--no-python {job_dir}/scripts/job.sh")


def test_every_attempt_of_a_job_writes_to_one_log(tmp_path: Path) -> None:
    """NeMo-Run's default names a log per restart (`..._%j_${SLURM_RESTART_COUNT:-0}.out`) and `nemo experiment logs`
    shows the first file it lists; one file opened for appending keeps every attempt where that command looks."""
    script = sbatch_script(slurm_executor(retries=1, job_dir=str(tmp_path / "experiments")), tmp_path)

    (job_dir,) = (tmp_path / "experiments" / "unit").glob("*/job")
    srun = srun_line(script)
    assert srun.startswith(f"srun --output {job_dir}/log-nemo_ckpt.job_%j.out ")
    assert "--open-mode=append" in srun and "RESTART_COUNT" not in srun


def test_sbatch_options_match_the_script(tmp_path: Path) -> None:
    executor = slurm_executor(
        partition="debug", nodes=3, ntasks_per_node=8, gpus_per_node=8, cpus_per_task=32, time="1-00:00:00"
    )
    assert sbatch_options(executor) == [
        "--cpus-per-task=32",
        "--gpus-per-node=8",
        "--nodes=3",
        "--ntasks-per-node=1",
        "--open-mode=append",
        "--partition=debug",
        "--time=1-00:00:00",
    ]


def test_signal_makes_torchrun_forward_it_and_wait_its_lead_time(tmp_path: Path) -> None:
    executor = slurm_executor(
        signal="USR1@90", env_vars={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "120"}, job_dir=str(tmp_path / "experiments")
    )

    script = sbatch_script(executor, tmp_path)

    assert "#SBATCH --signal=USR1@90" in sbatch_lines(script)
    assert "export PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1\n" in script
    assert "export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=120\n" in script, "the user's env vars win"
    assert slurm_executor(signal="TERM").env_vars == QUIET | {
        "PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "60",
    }
    assert slurm_executor().env_vars == QUIET


def test_torchrun_is_quiet_like_the_local_executor(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's agent logs at WARNING unless the shell asks for more; the user's env vars win."""
    assert slurm_executor().env_vars == QUIET
    assert slurm_executor(env_vars={"OMP_NUM_THREADS": "4"}).env_vars == {"LOGLEVEL": "WARNING", "OMP_NUM_THREADS": "4"}
    monkeypatch.setenv("LOGLEVEL", "INFO")
    assert slurm_executor().env_vars["LOGLEVEL"] == "INFO"


def test_ssh_tunnel_from_host_user_job_dir() -> None:
    executor = slurm_executor(
        host="login.example.org", user="alice", job_dir="/lustre/alice/exp", identity="~/.ssh/id_ed25519"
    )
    assert isinstance(executor.tunnel, run.SSHTunnel)
    assert (executor.tunnel.host, executor.tunnel.user, executor.tunnel.job_dir, executor.tunnel.identity) == (
        "login.example.org",
        "alice",
        "/lustre/alice/exp",
        "~/.ssh/id_ed25519",
    )
    assert isinstance(slurm_executor().tunnel, run.LocalTunnel)


def test_unreachable_ssh_tunnel_fails_before_submitting() -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    executor = slurm_executor(host="127.0.0.1", port=port, user="alice", job_dir="/lustre/alice/exp")

    with pytest.raises(ValueError, match=f"SSH tunnel: cannot reach 127.0.0.1:{port} .*check host/port"):
        check_submittable(executor, timeout=5)


def test_default_packager_needs_no_git_repo() -> None:
    assert type(slurm_executor().packager) is run.Packager


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"nodes": 0}, "nodes must be >= 1, got 0"),
        ({"ntasks_per_node": 0}, "ntasks_per_node must be >= 1"),
        ({"gpus_per_node": -1}, "gpus_per_node must be >= 0"),
        ({"gpus_per_node": 2, "ntasks_per_node": 4}, "ntasks_per_node=4 ranks exceed gpus_per_node=2"),
        ({"cpus_per_task": 0}, "cpus_per_task must be >= 1"),
        ({"time": "30 min"}, "time '30 min' is not a Slurm time limit"),
        ({"time": "1:75:00"}, "is not a Slurm time limit"),
        ({"account": " "}, "account must be a non-empty string"),
        ({"partition": ""}, "partition must be a non-empty string"),
        ({"container_mounts": ["/a:/b"]}, "container_mounts need a container_image"),
        ({"container_image": "img", "container_mounts": ["/only-src"]}, "'/only-src' is not SRC:DST"),
        ({"env_vars": {"BAD-NAME": "1"}}, "'BAD-NAME' is not a shell identifier"),
        ({"host": "login"}, "SSH tunnel \\(host\\) needs user and job_dir"),
        ({"user": "alice"}, "user/identity/port need host"),
        ({"signal": "B:USR1@60"}, "goes to the batch shell only.*drop .B:."),
        ({"signal": "NOPE@60"}, "'NOPE' is not a signal name"),
        ({"signal": "USR1 at 60"}, "signal 'USR1 at 60' is not"),
        ({"retries": -1}, "retries must be >= 0"),
        ({"job_dir": "/scratch/nemo_run/exp"}, "contains '/nemo_run'"),
    ],
)
def test_invalid_settings_raise_before_submission(kwargs: dict, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        slurm_executor(**kwargs)


def test_all_errors_are_reported_at_once() -> None:
    with pytest.raises(ValueError, match="nodes must be >= 1.*time 'soon'.*retries must be >= 0"):
        slurm_executor(nodes=0, time="soon", retries=-1)


@pytest.mark.parametrize("time", ["30", "30:00", "01:30:00", "2-00", "2-12:00", "7-00:00:00"])
def test_valid_time_limits(time: str) -> None:
    assert slurm_executor(time=time).time == time


def test_cli_factory_builds_validated_executor() -> None:
    ctx = RunContext(name="test")
    ctx.parse_args(
        [
            "executor=slurm",
            "executor.nodes=2",
            "executor.partition=batch",
            "executor.ntasks_per_node=8",
            "executor.gpus_per_node=8",
            "executor.signal=USR1@60",
            "executor.env_vars={'NCCL_DEBUG': 'INFO'}",
        ]
    )

    executor = ctx.executor
    assert isinstance(executor, run.SlurmExecutor)
    assert (
        executor.nodes,
        executor.partition,
        executor.torchrun_nproc_per_node,
        executor.gpus_per_node,
        executor.signal,
        executor.env_vars,
    ) == (
        2,
        "batch",
        8,
        8,
        "USR1@60",
        QUIET
        | {
            "PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
            "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "60",
            "NCCL_DEBUG": "INFO",
        },
    )

    with pytest.raises(ValueError, match="nodes must be >= 1, got 0"):
        RunContext(name="test").parse_args(["executor=slurm", "executor.nodes=0"])
