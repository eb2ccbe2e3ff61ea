"""NeMo-Run Slurm executor for nemo_ckpt jobs: sbatch + srun + torchrun.

``slurm_executor(...)`` validates its arguments and returns a ``run.SlurmExecutor`` that
launches one torchrun agent per node (``ntasks_per_node`` ranks each). The CLI factory
``slurm`` selects it with ``executor=slurm executor.nodes=2 ...``; the overrides are
arguments of ``slurm_executor`` and are validated when the executor is built.

Behaviour of NeMo-Run 0.11.1 worth knowing:

* every job is submitted as ``sbatch --requeue --parsable``; ``retries`` makes the batch
  script requeue itself after a failed run, ``signal="USR1@60"`` adds ``--signal``;
* ``env_vars`` become unquoted ``export KEY=value`` lines, so ``$VAR`` expands there;
* ``container_*`` need Pyxis on the cluster; without an image srun runs in the job dir,
  and NeMo-Run replaces every ``/nemo_run`` in the sbatch script by the job dir, so the
  experiments dir must not contain ``/nemo_run`` (``~/.nemo_run`` is fine);
* with the local tunnel, ``job_dir`` must be ``<Experiment base_dir>/experiments``
  (``""`` means ``$NEMORUN_HOME/experiments``), because the sbatch script is written
  to the experiment dir and submitted from the tunnel's job dir;
* waiting for a job (``exp.run()`` without ``detach=True``) and ``nemo experiment
  status/logs`` query ``sacct``, which needs Slurm accounting (slurmdbd); without it
  they see UNKNOWN, but the logs are still written to
  ``<job dir>/log-nemo_ckpt.<task>_<job id>_<restart>.out``.
"""

import re
import shlex
from dataclasses import asdict
from typing import Any, Optional

import nemo_run as run
from nemo_run.config import RUNDIR_NAME, get_nemorun_home

_TIME = re.compile(r"^(\d+-\d+(:[0-5]\d){0,2}|\d+(:[0-5]\d){0,2})$")
_SIGNAL = re.compile(r"^([RB]{1,2}:)?[A-Z0-9]+(@\d+)?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
JOB_NAME_PREFIX = "nemo_ckpt."


def slurm_executor(
    account: Optional[str] = None,
    partition: Optional[str] = None,
    nodes: int = 1,
    ntasks_per_node: int = 1,
    gpus_per_node: int = 0,
    cpus_per_task: Optional[int] = None,
    time: str = "00:30:00",
    container_image: Optional[str] = None,
    container_mounts: Optional[list[str]] = None,
    env_vars: Optional[dict[str, str]] = None,
    host: Optional[str] = None,
    user: Optional[str] = None,
    identity: Optional[str] = None,
    job_dir: str = "",
    packager: Optional[run.Packager] = None,
    signal: Optional[str] = None,
    retries: int = 0,
    additional_parameters: Optional[dict[str, Any]] = None,
) -> run.SlurmExecutor:
    """A validated ``run.SlurmExecutor`` running torchrun with ``ntasks_per_node`` ranks per node.

    ``host``/``user``/``job_dir`` select an SSH tunnel to a login node (``job_dir`` is the
    cluster-side experiments dir); without ``host`` jobs are submitted with the local
    ``sbatch``. ``partition=None`` uses the cluster's default partition. The default
    packager ships no code: the job runs with the code and Python already on the
    cluster (shared file system or ``container_image``). torchrun is the only task per
    node, so ``cpus_per_task`` is the CPU share of all ranks on a node.
    """
    if (user or identity) and not host:
        raise ValueError("invalid Slurm executor: user/identity need host (SSH tunnel)")
    if host:
        tunnel = run.SSHTunnel(host=host, user=user, job_dir=job_dir, identity=identity)
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
        env_vars=dict(env_vars or {}),
        signal=signal,
        retries=retries,
        additional_parameters=additional_parameters,
        tunnel=tunnel,
        packager=packager or run.Packager(),
        launcher="torchrun",
        poll_estimated_start_time=False,
    )
    validate(executor)
    return executor


def validate(executor: run.SlurmExecutor) -> None:
    """Raise ``ValueError`` listing everything wrong with the executor's settings."""
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
    errors += [f"container mount {m!r} is not SRC:DST[:FLAGS]" for m in mounts
               if len(m.split(":")) not in (2, 3) or not all(m.split(":")[:2])]
    errors += [f"env var name {k!r} is not a shell identifier" for k in e.env_vars if not _ENV_NAME.match(k)]
    jobs_root = e.tunnel.job_dir or get_nemorun_home()
    if not e.container_image and f"/{RUNDIR_NAME}" in jobs_root:
        errors.append(f"job dir {jobs_root!r} contains '/{RUNDIR_NAME}', which NeMo-Run rewrites "
                      "in sbatch scripts of jobs without a container")
    if isinstance(e.tunnel, run.SSHTunnel) and not (e.tunnel.user and e.tunnel.job_dir):
        errors.append("an SSH tunnel (host) needs user and job_dir")
    if e.signal is not None and not _SIGNAL.match(e.signal):
        errors.append(f"signal {e.signal!r} is not [R|B:]SIG[@seconds], e.g. USR1@60")
    if e.retries < 0:
        errors.append(f"retries must be >= 0, got {e.retries}")
    if errors:
        raise ValueError("invalid Slurm executor: " + "; ".join(errors))


@run.cli.factory(name="slurm")
def slurm() -> run.Config[run.SlurmExecutor]:
    """CLI factory: ``executor=slurm executor.nodes=2``; fields are ``slurm_executor``'s arguments."""
    return run.Config(slurm_executor)


def sbatch_options(executor: run.SlurmExecutor) -> list[str]:
    """The resource options (``--nodes=2`` ...) NeMo-Run puts in the executor's sbatch script."""
    executor.get_launcher()  # torchrun turns ntasks_per_node into one agent per node
    params = {k: v for k, v in asdict(executor).items()
              if v is not None and k in run.SlurmExecutor.SBATCH_FLAGS and k != "job_name"}
    params |= executor.additional_parameters or {}
    return [f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')}={v}"
            for k, v in sorted(params.items())]


def check_submittable(executor: run.SlurmExecutor) -> str:
    """Ask the cluster (``sbatch --test-only``) whether the executor's resources can be granted.

    Catches unknown partitions, node counts and GPUs no partition has, and (where the
    cluster enforces them) accounts and time limits above the partition's MaxTime,
    without queueing anything. Returns sbatch's estimate; raises ``ValueError`` with
    sbatch's message otherwise.
    """
    cmd = ["sbatch", "--test-only", *sbatch_options(executor), "--wrap=true"]
    result = executor.tunnel.run(shlex.join(cmd), hide=True, warn=True, in_stream=False)
    message = (result.stderr + result.stdout).strip()
    if result.return_code != 0:
        raise ValueError(f"Slurm rejects this job ({shlex.join(cmd)}): {message}")
    return message
