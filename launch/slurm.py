"""NeMo-Run Slurm executor for nemo_ckpt jobs: sbatch + srun + torchrun.

`slurm_executor(...)` validates its arguments and returns a `run.SlurmExecutor` that
launches one torchrun agent per node (`ntasks_per_node` ranks each). The CLI factory
`slurm` selects it with `executor=slurm executor.nodes=2 ...`; the overrides are
arguments of `slurm_executor` and are validated when the executor is built.

Behaviour of NeMo-Run 0.11.1 worth knowing:

* every job is submitted as `sbatch --requeue --parsable`; `retries` makes the batch
  script requeue itself after a failed run, `signal="USR1@60"` adds `--signal`;
* Slurm sends `--signal` to every process of the job steps: torchrun and its workers.
  torchrun dies of SIGUSR1 unless told to handle it, so `slurm_executor` adds the signal
  to `PET_SIGNALS_TO_HANDLE` and sets `TORCH_ELASTIC_SHUTDOWN_TIMEOUT` to its lead time:
  torchrun then forwards it and waits that long for the workers, whose
  `nemo_ckpt.checkpoint.preemption.PreemptionCallback` checkpoints, stops and requeues the job.
  `B:` (batch shell only) is refused: NeMo-Run's batch script does not trap it and dies;
* torchrun's agent logs at WARNING and `OMP_NUM_THREADS=1` (`launcher_env`, as the local executor);
* `nodes > 1`: torchrun's multi-node rendezvous (`--nnodes N --rdzv-backend c10d --rdzv-endpoint
  $head_node_ip:29500`, the first node's address from `hostname --ip-address` there); srun runs with
  `--kill-on-bad-exit=1`, so a rank that fails (a process-group timeout) ends the job on every node, and
  `--label`: each line of the job's log starts with the node's task number (`0: `, `1: `);
* `check_job(task, executor)` checks before submitting what NeMo-Run leaves to the job: the recipe's
  `trainer.num_nodes`/`devices` against `nodes`/`ntasks_per_node`, parallel sizes dividing the world
  size, the partition's node count (`sinfo`), then `sbatch --test-only`; `nemo ... run.executor=slurm`
  runs it before submitting (the layout part also with `--dryrun`), and warns (`SlurmPathWarning`) of a relative
  `log.log_dir` or job dir, which would resolve against the job's working directory on the compute node;
* `env_vars` become unquoted `export KEY=value` lines, so `$VAR` expands there;
* `container_*` need Pyxis on the cluster; without an image srun runs in the job dir,
  and NeMo-Run replaces every `/nemo_run` in the sbatch script by the job dir, so the
  experiments dir must not contain `/nemo_run` (`~/.nemo_run` is fine);
* with the local tunnel, `job_dir` must be `<Experiment base_dir>/experiments`
  (`""` means `$NEMORUN_HOME/experiments`), because the sbatch script is written
  to the experiment dir and submitted from the tunnel's job dir;
* waiting for a job (`exp.run()` without `detach=True`) and `nemo experiment
  status/logs` query `sacct`, which needs Slurm accounting (slurmdbd); without it
  they see UNKNOWN;
* NeMo-Run names the job log after the restart count, one file per (re)start, and `nemo experiment logs`
  shows the first file only. `JobLog` keeps every attempt in one `<job dir>/log-nemo_ckpt.<task>_<job id>.out`
  (srun `--open-mode=append`); in each attempt the first process of every node logs
  `Slurm job <id>: attempt <n> on <host>` (`NeMoLogger.setup`).
"""

import os
import re
import shlex
import shutil
import socket
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import nemo_run as run
from nemo_run.config import RUNDIR_NAME, get_nemorun_home
from nemo_run.core.execution.slurm import SlurmJobDetails

from nemo_ckpt._compat import nemo_run_experiment_dir
from nemo_ckpt.checkpoint.preemption import signal_number
from nemo_ckpt.logger.text_log import launcher_env
from nemo_ckpt.parallel.mesh import PARALLEL_SIZE_OPTIONS, ParallelDims

_TIME = re.compile(r"^(\d+-\d+(:[0-5]\d){0,2}|\d+(:[0-5]\d){0,2})$")
_SIGNAL = re.compile(r"^(?P<flags>[RB]{1,2}:)?(?P<name>[A-Z0-9]+)(@(?P<seconds>\d+))?$")
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # torchrun's default PET_SIGNALS_TO_HANDLE
SLURM_DEFAULT_SIGNAL_SECONDS = 60
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
JOB_NAME_PREFIX = "nemo_ckpt."


class SlurmPathWarning(UserWarning):
    """A relative path of a Slurm job: it resolves on the compute node, against the job's working directory."""


@dataclass(kw_only=True)
class JobLog(SlurmJobDetails):
    """One log file per job for all its (re)starts, which `nemo experiment logs` then shows whole."""

    @property
    def srun_stdout(self) -> Path:
        assert self.folder, self.job_name
        return Path(self.folder) / f"log-{self.job_name}_%j.out"

    @property
    def srun_stderr(self) -> Path:
        assert self.folder, self.job_name
        return Path(self.folder) / f"log-{self.job_name}_%j.err"


def slurm_executor(
    account: str | None = None,
    partition: str | None = None,
    nodes: int = 1,
    ntasks_per_node: int = 1,
    gpus_per_node: int = 0,
    cpus_per_task: int | None = None,
    time: str = "00:30:00",
    container_image: str | None = None,
    container_mounts: list[str] | None = None,
    env_vars: dict[str, str] | None = None,
    host: str | None = None,
    user: str | None = None,
    identity: str | None = None,
    port: int | None = None,
    job_dir: str = "",
    packager: run.Packager | None = None,
    signal: str | None = None,
    retries: int = 0,
    additional_parameters: dict[str, Any] | None = None,
) -> run.SlurmExecutor:
    """A validated `run.SlurmExecutor` running torchrun with `ntasks_per_node` ranks per node.

    `host`/`user`/`job_dir` (`identity`, `port`) select an SSH tunnel to a login node
    (`job_dir` is the cluster-side experiments dir); without `host` jobs are submitted
    with the local `sbatch`. `signal="USR1@120"` asks Slurm for SIGUSR1 120 s before the
    time limit, on which the recipe's `PreemptionCallback` checkpoints and requeues the job.
    `partition=None` uses the cluster's default partition. The default
    packager ships no code: the job runs with the code and Python already on the
    cluster (shared file system or `container_image`). torchrun is the only task per
    node, so `cpus_per_task` is the CPU share of all ranks on a node.
    """
    if (user or identity or port) and not host:
        raise ValueError("invalid Slurm executor: user/identity/port need host (SSH tunnel)")
    if host:
        tunnel = run.SSHTunnel(host=host, user=user, job_dir=job_dir, identity=identity, port=port)
    else:
        tunnel = run.LocalTunnel(job_dir=job_dir)
    executor = run.SlurmExecutor(
        account=account,
        partition=partition,
        job_name_prefix=JOB_NAME_PREFIX,
        nodes=nodes,
        ntasks_per_node=ntasks_per_node,
        torchrun_nproc_per_node=ntasks_per_node,
        gpus_per_node=gpus_per_node or None,
        cpus_per_task=cpus_per_task,
        time=time,
        container_image=container_image,
        container_mounts=list(container_mounts or []),
        env_vars=launcher_env() | torchrun_signal_env(signal) | dict(env_vars or {}),
        signal=signal,
        retries=retries,
        additional_parameters=additional_parameters,
        srun_args=["--open-mode=append", *(["--label"] if nodes > 1 else [])],
        job_details=JobLog(),
        tunnel=tunnel,
        packager=packager or run.Packager(),
        launcher="torchrun",
        poll_estimated_start_time=False,
    )
    validate(executor)
    return executor


def torchrun_signal_env(slurm_signal: str | None) -> dict[str, str]:
    """Env vars that make torchrun forward `--signal`'s signal and wait its lead time for the workers."""
    match = _SIGNAL.match(slurm_signal or "")
    if not match:
        return {}
    try:
        name = signal_number(match["name"]).name
    except ValueError:
        return {}
    seconds = match["seconds"] or str(SLURM_DEFAULT_SIGNAL_SECONDS)
    handled = TORCHRUN_SIGNALS if name in TORCHRUN_SIGNALS.split(",") else f"{TORCHRUN_SIGNALS},{name}"
    return {"PET_SIGNALS_TO_HANDLE": handled, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": seconds}


def validate(executor: run.SlurmExecutor) -> None:
    """Raise `ValueError` listing everything wrong with the executor's settings."""
    e = executor
    ranks = e.torchrun_nproc_per_node or e.ntasks_per_node
    mounts = e.container_mounts
    errors = []
    if e.account is not None and not e.account.strip():
        errors.append("account must be a non-empty string or None")
    if e.partition is not None and not e.partition.strip():
        errors.append("partition must be a non-empty string or None")
    if e.nodes < 1:
        errors.append(f"nodes must be >= 1, got {e.nodes}")
    if ranks < 1:
        errors.append(f"ntasks_per_node must be >= 1, got {ranks}")
    if e.gpus_per_node is not None and e.gpus_per_node < 0:
        errors.append(f"gpus_per_node must be >= 0, got {e.gpus_per_node}")
    elif e.gpus_per_node and ranks > e.gpus_per_node:
        errors.append(f"ntasks_per_node={ranks} ranks exceed gpus_per_node={e.gpus_per_node}")
    if e.cpus_per_task is not None and e.cpus_per_task < 1:
        errors.append(f"cpus_per_task must be >= 1, got {e.cpus_per_task}")
    if not _TIME.match(e.time):
        errors.append(f"time {e.time!r} is not a Slurm time limit (MM, MM:SS, HH:MM:SS, D-HH[:MM[:SS]])")
    if mounts and not e.container_image:
        errors.append("container_mounts need a container_image")
    errors += [
        f"container mount {m!r} is not SRC:DST[:FLAGS]"
        for m in mounts
        if len(m.split(":")) not in (2, 3) or not all(m.split(":")[:2])
    ]
    errors += [f"env var name {k!r} is not a shell identifier" for k in e.env_vars if not _ENV_NAME.match(k)]
    jobs_root = e.tunnel.job_dir or get_nemorun_home()
    if not e.container_image and f"/{RUNDIR_NAME}" in jobs_root:
        errors.append(
            f"job dir {jobs_root!r} contains '/{RUNDIR_NAME}', which NeMo-Run rewrites "
            "in sbatch scripts of jobs without a container"
        )
    if isinstance(e.tunnel, run.SSHTunnel) and not (e.tunnel.user and e.tunnel.job_dir):
        errors.append("an SSH tunnel (host) needs user and job_dir")
    signal_match = _SIGNAL.match(e.signal or "")
    if e.signal is not None and not signal_match:
        errors.append(f"signal {e.signal!r} is not [R:]SIG[@seconds], e.g. USR1@60")
    elif signal_match and "B" in (signal_match["flags"] or ""):
        errors.append(
            f"signal {e.signal!r} goes to the batch shell only, which NeMo-Run's sbatch script does "
            f"not trap (the job dies); drop 'B:' so torchrun and the workers get it, e.g. USR1@60"
        )
    elif signal_match:
        try:
            signal_number(signal_match["name"])
        except ValueError as error:
            errors.append(f"signal {e.signal!r}: {error}")
    if e.retries < 0:
        errors.append(f"retries must be >= 0, got {e.retries}")
    if errors:
        raise ValueError("invalid Slurm executor: " + "; ".join(errors))


@run.cli.factory(name="slurm")
def slurm() -> run.Config[run.SlurmExecutor]:
    """CLI factory: `executor=slurm executor.nodes=2`; fields are `slurm_executor`'s arguments."""
    return run.Config(slurm_executor)


def sbatch_options(executor: run.SlurmExecutor) -> list[str]:
    """The resource options (`--nodes=2` ...) NeMo-Run puts in the executor's sbatch script."""
    executor.get_launcher()  # torchrun turns ntasks_per_node into one agent per node
    params = {
        k: v
        for k, v in asdict(executor).items()
        if v is not None and k in run.SlurmExecutor.SBATCH_FLAGS and k != "job_name"
    }
    params |= executor.additional_parameters or {}
    return [
        f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')}={v}" for k, v in sorted(params.items())
    ]


def check_submittable(executor: run.SlurmExecutor, timeout: float = 10) -> str:
    """Ask the cluster (`sbatch --test-only`) whether the executor's job can be granted; submit nothing.

    Checks first that an SSH tunnel's host answers on its port within `timeout` seconds.
    Catches unknown partitions, node counts and GPUs no partition has, and (where the
    cluster enforces them) missing or unknown accounts and time limits above the
    partition's MaxTime. Returns sbatch's estimate; raises `ValueError` saying what to fix.
    """
    tunnel = executor.tunnel
    if isinstance(tunnel, run.SSHTunnel):
        address = (tunnel.host, tunnel.port or 22)
        try:
            socket.create_connection(address, timeout=timeout).close()
        except OSError as error:
            raise ValueError(
                f"SSH tunnel: cannot reach {tunnel.host}:{address[1]} ({error}); check host/port, or your VPN"
            ) from error
    cmd = ["sbatch", "--test-only", *sbatch_options(executor), "--wrap=true"]
    result = tunnel.run(shlex.join(cmd), hide=True, warn=True, in_stream=False)
    message = (result.stderr + result.stdout).strip()
    if result.return_code != 0:
        hint = ""
        if "account" in message.lower():
            hint = (
                f"; set account= to one of your Slurm accounts (account={executor.account!r} is not one; "
                "`sacctmgr show assoc user=$USER format=account` lists them)"
            )
        raise ValueError(f"Slurm rejects this job ({shlex.join(cmd)}): {message}{hint}")
    return message


def sbatch_script(task: run.Partial | run.Script, executor: run.SlurmExecutor, name: str = "pretrain") -> str:
    """The sbatch script NeMo-Run generates for `task` on `executor`, without submitting anything."""
    with run.Experiment(f"dryrun-{name}", executor=executor, log_level="WARN") as experiment:
        experiment.add(task, name=name)
        experiment.dryrun(log=False, delete_exp_dir=False)
    experiment_dir = nemo_run_experiment_dir(experiment)
    try:
        return next(experiment_dir.glob("*_sbatch.sh")).read_text()
    finally:
        shutil.rmtree(experiment_dir, ignore_errors=True)


def check_job(task: run.Partial | run.Script, executor: run.SlurmExecutor, timeout: float = 10) -> str:
    """Everything checkable before `sbatch`: `check_layout`, `check_partition_nodes`, `check_submittable`.

    Raises `ValueError` saying what to fix, with nothing submitted; returns sbatch's start estimate.
    """
    check_layout(task, executor)
    check_partition_nodes(executor, timeout=timeout)
    return check_submittable(executor, timeout=timeout)


def check_layout(task: run.Partial | run.Script, executor: run.SlurmExecutor) -> None:
    """The recipe's Trainer fits the executor's job: `trainer.num_nodes == nodes`, `trainer.devices ==
    ntasks_per_node`, and its strategy's parallel sizes fit the world size (`ParallelDims`, the strategy's own
    rules: TP x PP x CP divides it, EP divides DP x CP). A task without a Trainer (a script) passes. Raises
    `ValueError` naming the settings and both ways to fix them. Also: the data's global batch is a multiple of micro
    batch x data-parallel size. Warns (`SlurmPathWarning`) of each of `relative_paths`."""
    for message in relative_paths(task, executor):
        warnings.warn(message, SlurmPathWarning, stacklevel=2)
    trainer = _argument(task, "trainer")
    if trainer is None:
        return
    nodes, ranks = executor.nodes, executor.torchrun_nproc_per_node or executor.ntasks_per_node
    world = nodes * ranks
    errors = []
    num_nodes, devices = _argument(trainer, "num_nodes", 1), _argument(trainer, "devices", "auto")
    if num_nodes != nodes:
        errors.append(
            f"trainer.num_nodes={num_nodes} but the executor has nodes={nodes}: set trainer.num_nodes={nodes} "
            f"or run.executor.nodes={num_nodes}"
        )
    if isinstance(devices, int) and devices != ranks:
        errors.append(
            f"trainer.devices={devices} but the executor starts ntasks_per_node={ranks} ranks per node: set "
            f"trainer.devices={ranks} or run.executor.ntasks_per_node={devices}"
        )
    strategy = _argument(trainer, "strategy")
    data_parallel = world
    if isinstance(strategy, run.Config):
        sizes = {dim: _argument(strategy, option, 1) or 1 for dim, option in PARALLEL_SIZE_OPTIONS.items()}
        try:
            data_parallel = ParallelDims(world, **sizes).dp
        except ValueError as error:
            errors.append(f"{error} (world size = nodes={nodes} x ntasks_per_node={ranks})")
            data_parallel = 0
    data = _argument(task, "data")
    global_batch, micro_batch = _argument(data, "global_batch_size"), _argument(data, "micro_batch_size")
    batches_known = isinstance(global_batch, int) and isinstance(micro_batch, int) and data_parallel > 0
    if batches_known and global_batch % (micro_batch * data_parallel):
        errors.append(
            f"data.global_batch_size={global_batch} is not a multiple of data.micro_batch_size={micro_batch} x "
            f"data-parallel size {data_parallel}: set data.global_batch_size to a multiple of "
            f"{micro_batch * data_parallel}"
        )
    if errors:
        raise ValueError("recipe and Slurm executor do not fit: " + "; ".join(errors))


def relative_paths(task: run.Partial | run.Script, executor: run.SlurmExecutor) -> list[str]:
    """What would go elsewhere than meant: a relative job dir, or a relative `log.log_dir` (`explicit_log_dir`),
    which on the compute node resolves against the job's working directory (`srun --chdir <job dir>/code`),
    not the directory `nemo` ran in, and which the next submission, in a new job dir, would not find to resume."""
    messages = []
    jobs_root = executor.tunnel.job_dir or get_nemorun_home()
    if not os.path.isabs(os.path.expanduser(jobs_root)):
        messages.append(
            f"job_dir {jobs_root!r} is relative: the sbatch script's paths (--output, srun --chdir) would resolve "
            "against the working directory of sbatch and of the job on the compute node; set an absolute job_dir"
        )
    log = _argument(task, "log")
    key = "explicit_log_dir" if _argument(log, "explicit_log_dir") else "log_dir"
    log_dir = _argument(log, key)
    if isinstance(log_dir, (str, os.PathLike)) and not os.path.isabs(os.path.expanduser(log_dir)):
        messages.append(
            f"log.{key}={str(log_dir)!r} is relative: on the compute node it resolves against the job's working "
            "directory (<job dir>/code, a new one for each submission), not where nemo ran, so logs and checkpoints "
            "land there and a resubmitted run starts afresh; set an absolute path"
            + (f", e.g. log.{key}={os.path.abspath(log_dir)}" if isinstance(executor.tunnel, run.LocalTunnel) else "")
        )
    return messages


def check_partition_nodes(executor: run.SlurmExecutor, timeout: float = 10) -> None:
    """Ask `sinfo` (through the executor's tunnel) whether the partition exists and has `executor.nodes` nodes."""
    cmd = shlex.join(["sinfo", "--noheader", "--format=%P|%D"])
    try:
        result = executor.tunnel.run(cmd, hide=True, warn=True, in_stream=False, timeout=timeout)
    except Exception as error:  # invoke/fabric raise their own types for a missing command or a timeout
        raise ValueError(f"cannot list the Slurm partitions ({cmd}): {error}") from error
    if result.return_code != 0:
        raise ValueError(f"cannot list the Slurm partitions ({cmd}): {(result.stderr + result.stdout).strip()}")
    nodes: dict[str, int] = {}
    default = None
    for line in result.stdout.split():
        name, count = line.rsplit("|", 1)
        if name.endswith("*"):
            name = default = name[:-1]
        nodes[name] = nodes.get(name, 0) + int(count)
    partition = executor.partition or default
    if partition is None:
        raise ValueError("the cluster has no default partition: set partition= to one of " + ", ".join(nodes))
    if partition not in nodes:
        raise ValueError(f"partition {partition!r} does not exist: set partition= to one of " + ", ".join(nodes))
    if executor.nodes > nodes[partition]:
        raise ValueError(
            f"partition {partition!r} has {nodes[partition]} node(s), the job asks for nodes={executor.nodes}: "
            "lower nodes or choose a partition with more (`sinfo` lists them)"
        )


def _argument(config: Any, name: str, default: Any = None) -> Any:
    """A Fiddle config's argument (set, or its signature's default); `default` if it has no such argument."""
    try:
        return getattr(config, name)
    except AttributeError:
        return default
