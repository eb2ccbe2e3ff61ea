"""The tiny recipe on a real two-node Slurm cluster (node0, node1: two slurmds, each in its own network namespace):
torchrun's multi-node rendezvous, resume on 2 and on 1 node with bit-identical weights, a hung rank failing the job
within the process-group timeout and the retry resuming, a node killed outright and the requeue resuming once it is
back, USR1 preemption across both nodes (2 ranks each)."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import nemo_run as run
import pytest
import torch

from launch.slurm import check_job, check_partition_nodes, slurm_executor
from nemo_ckpt import dist_checkpointing
from recipes import pretrain_recipe
from tests.slurm.cluster import SlurmCluster, cluster_sh
from tests.slurm.jobs import attempts, job_log, logged_steps, nemo, node_logs

REPO = Path(__file__).resolve().parents[2]
JOB_ENV = {"PATH": f"{Path(sys.executable).parent}:$PATH", "PYTHONPATH": str(REPO)}  # this venv, this checkout
MICRO_BATCH = 4  # global batch 8 where there are 2 ranks: 2 nodes x 1 rank and 1 node x 2 ranks are both dp=2
# gloo's error for the operations in flight other than the recv that timed out (see the hung-rank test)
GLOO_PAIR_CLOSURE = "Application timeout caused pair closure"


def tiny(
    log_dir: Path,
    nodes: int,
    max_steps: int,
    every: int,
    decay_steps: int | None = None,
    ranks_per_node: int | None = None,
) -> run.Partial:
    """The tiny recipe on `nodes` x `ranks_per_node` ranks (2 in all by default), a micro batch of 4 per rank."""
    ranks_per_node = ranks_per_node or 2 // nodes
    recipe = pretrain_recipe(
        name="tiny",
        dir=str(log_dir),
        num_nodes=nodes,
        num_gpus_per_node=ranks_per_node,
        max_steps=max_steps,
        micro_batch_size=MICRO_BATCH,
        global_batch_size=nodes * ranks_per_node * MICRO_BATCH,
    )
    recipe.log.ckpt.every_n_train_steps = every
    recipe.log.ckpt.save_top_k = -1
    recipe.optim.lr_decay_steps = decay_steps  # the same LR schedule for a run cut short and its resumption
    return recipe


def submit(recipe: run.Partial, nodes: int, **executor_args) -> tuple[str, Path]:
    """Check, then submit `recipe` detached on `nodes` nodes, with the recipe's ranks per node; return (Slurm job id,
    job dir)."""
    executor = slurm_executor(
        nodes=nodes, ntasks_per_node=recipe.trainer.devices, time="00:10:00", env_vars=JOB_ENV, **executor_args
    )
    check_job(recipe, executor)
    with run.Experiment("tiny", executor=executor, log_level="WARN") as exp:
        exp.add(recipe, name="pretrain")
        exp.run(detach=True)
        return exp.jobs[0].handle.rsplit("/", 1)[-1], Path(exp.jobs[0].executor.job_dir)


def manifest(log_dir: Path) -> list[dict]:
    path = log_dir / "tiny" / "checkpoints" / "checkpoints.json"
    return json.loads(path.read_text())["checkpoints"] if path.exists() else []


def checkpoint_of(log_dir: Path, step: int) -> Path:
    [name] = [record["name"] for record in manifest(log_dir) if record["step"] == step]
    return log_dir / "tiny" / "checkpoints" / name


def weights(log_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return dist_checkpointing.load_plain_tensors(checkpoint_of(log_dir, step) / "weights")


def wait_for_checkpoint(cluster: SlurmCluster, job_id: str, log_dir: Path, timeout: float = 240) -> int:
    """The step of the first complete checkpoint, once there is one and no save is under way."""
    deadline = time.monotonic() + timeout
    while not (records := manifest(log_dir)) or {record["state"] for record in records} != {"complete"}:
        assert time.monotonic() < deadline, f"no checkpoint yet: {cluster.job(job_id)}"
        time.sleep(0.1)
    return records[-1]["step"]


def worker_pid(job_id: str, node_id: int) -> int:
    """The PID of the training process of job `job_id` on node `node_id`: the child of that node's torchrun (its own
    children, e.g. multiprocessing helpers, carry the same environment)."""
    for proc in Path("/proc").iterdir():
        try:
            env = dict(item.split("=", 1) for item in (proc / "environ").read_text().split("\0") if "=" in item)
            parent = (proc / "stat").read_text().rsplit(")", 1)[1].split()[1]
            parent_cmdline = Path("/proc", parent, "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if (
            env.get("SLURM_JOB_ID") == job_id
            and env.get("SLURM_NODEID") == str(node_id)
            and "LOCAL_RANK" in env
            and b"torchrun" in parent_cmdline
        ):
            return int(proc.name)
    raise LookupError(f"no worker of job {job_id} on node {node_id}")


def first_and_last_attempts(log: str, job_id: str, restarts: int) -> tuple[str, str]:
    """A node's text of the job's first attempt and of its last (the `restarts`-th requeue, per Slurm), both of which
    the node must have logged; attempts in between may have ended before the node's rank logged anything."""
    runs = attempts(log, job_id)
    assert 1 in runs and restarts + 1 in runs and max(runs) == restarts + 1, f"attempts {sorted(runs)} in the log"
    return runs[1], runs[restarts + 1]


def test_two_nodes_each_with_its_own_address(two_node_cluster: SlurmCluster, tmp_path: Path) -> None:
    out = subprocess.run(["sinfo", "--noheader", "--format=%P %t %D %N"], check=True, capture_output=True, text=True)
    assert out.stdout.split() == ["debug*", "idle", "2", "node[0-1]"]
    job_id = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--nodes=2",
            "--time=00:01:00",
            f"--output={tmp_path / 'out.txt'}",
            "--wrap",
            "srun bash -c 'echo $(hostname) $(hostname --ip-address) $SLURM_NODEID'",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()

    assert two_node_cluster.wait(job_id)["JobState"] == "COMPLETED"
    subnet = (two_node_cluster.dir / "net").read_text().strip()
    lines = sorted((tmp_path / "out.txt").read_text().splitlines())
    assert lines == [f"node0 10.231.{subnet}.2 0", f"node1 10.231.{subnet}.3 1"]


def test_partition_node_count_is_checked_before_submitting(two_node_cluster: SlurmCluster, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="partition 'debug' has 2 node\\(s\\), the job asks for nodes=3"):
        check_partition_nodes(slurm_executor(nodes=3))
    with pytest.raises(ValueError, match="partition 'gpu' does not exist: set partition= to one of debug"):
        check_partition_nodes(slurm_executor(nodes=2, partition="gpu"))
    assert "to start at" in check_job(tiny(tmp_path, nodes=2, max_steps=1, every=1), slurm_executor(nodes=2))


def test_resume_on_two_and_on_one_node_is_bit_identical(
    two_node_cluster: SlurmCluster, nemorun_home: Path, tmp_path: Path
) -> None:
    """2 nodes x 1 rank train 4 of 8 steps; one job resumes them on 2 nodes (submitted by `nemo ... run.executor=slurm
    run.executor.nodes=2 --yes`), another on 1 node x 2 ranks; both end with the weights of 8 steps on 1 node (all
    with global batch 8, the same LR schedule)."""
    two, one, reference = tmp_path / "two", tmp_path / "one", tmp_path / "reference"
    first_id, first_dir = submit(tiny(two, nodes=2, max_steps=4, every=4, decay_steps=8), nodes=2)
    reference_id, _ = submit(tiny(reference, nodes=1, max_steps=8, every=8), nodes=1)
    first = two_node_cluster.wait(first_id, timeout=240)

    logs = node_logs(job_log(first_dir, first_id))
    assert first["JobState"] == "COMPLETED" and first["NodeList"] == "node[0-1]", logs
    assert "GLOBAL_RANK: 0, MEMBER: 1/2" in logs[0] and "GLOBAL_RANK: 1, MEMBER: 2/2" in logs[1]
    assert "`Trainer.fit` stopped: `max_steps=4` reached." in logs[0]
    shards = sorted(p.name for p in (checkpoint_of(two, 4) / "weights").glob("*.distcp"))
    assert {name.split("_")[2] for name in shards} == {"0", "1"}, f"both nodes' ranks write shards: {shards}"
    shutil.copytree(two, one, symlinks=True)  # `-last` is a relative symlink

    resume_one_id, resume_one_dir = submit(tiny(one, nodes=1, max_steps=8, every=8, decay_steps=8), nodes=1)
    output = nemo(  # the same resumption on 2 nodes from the command line, which submits, then waits for the job
        "nemo_ckpt",
        "pretrain",
        "--factory",
        "tiny",
        f"log.log_dir={two}",
        "log.ckpt.every_n_train_steps=8",
        "log.ckpt.save_top_k=-1",
        "trainer.num_nodes=2",
        "trainer.devices=1",
        "trainer.max_steps=8",
        "optim.lr_decay_steps=8",
        "run.executor=slurm",
        "run.executor.nodes=2",
        "run.executor.ntasks_per_node=1",
        "run.executor.time=00:10:00",
        f"run.executor.env_vars={JOB_ENV!r}",
        "--yes",
    )
    assert "SUCCEEDED" in output, output
    [cli_log] = (nemorun_home / "experiments").glob("pretrain/pretrain_*/pretrain/log-nemo_ckpt.pretrain_*.out")
    logs = node_logs(cli_log.read_text())
    assert logs.keys() == {0, 1}, "both nodes"
    assert f"Restoring states from the checkpoint path at {checkpoint_of(two, 4)}" in logs[0]
    info = two_node_cluster.wait(resume_one_id, timeout=240)
    log = job_log(resume_one_dir, resume_one_id)  # one node: no labels
    assert info["JobState"] == "COMPLETED", log
    assert f"Restoring states from the checkpoint path at {checkpoint_of(one, 4)}" in log
    assert two_node_cluster.wait(reference_id, timeout=240)["JobState"] == "COMPLETED"

    expected = weights(reference, 8)
    for resumed in (weights(two, 8), weights(one, 8)):
        assert resumed.keys() == expected.keys()
        for key, tensor in expected.items():
            assert torch.equal(resumed[key], tensor), key


def test_hung_rank_fails_the_job_within_the_timeout_and_the_retry_resumes(
    two_node_cluster: SlurmCluster, nemorun_home: Path, tmp_path: Path
) -> None:
    """SIGSTOP of node1's rank: node0's rank times out in its next collective (`MegatronStrategy(timeout=...)`), srun
    kills the step on both nodes, NeMo-Run's retry requeues the job, which resumes from the last checkpoint.

    The recv that times out raises `Timed out waiting <T>ms`; gloo then fails the other operations in flight on the
    context with `Application timeout caused pair closure`, and the one rank 0 waits on may be either (once, in CI,
    Lightning's metric-sync barrier got the latter). That the timeout is the configured one shows in when the job is
    requeued: after T, not after torch's default of 30 minutes.

    `retries=2`: on a loaded machine node1's slurmd can be so late cleaning up the first attempt that its terminate
    order for the job (same job id) kills the first retry on node1; the next retry then runs (seen with Slurm 22.05).
    """
    timeout_s, max_steps = 20, 40
    log_dir = tmp_path / "runs"
    recipe = tiny(log_dir, nodes=2, max_steps=max_steps, every=10)
    recipe.trainer.strategy.timeout = run.Config(timedelta, seconds=timeout_s)
    job_id, job_dir = submit(recipe, nodes=2, retries=2)
    saved = wait_for_checkpoint(two_node_cluster, job_id, log_dir)

    os.kill(worker_pid(job_id, node_id=1), signal.SIGSTOP)
    stopped = time.monotonic()
    while two_node_cluster.job(job_id)["Restarts"] == "0":
        assert time.monotonic() - stopped < 3 * timeout_s, f"still running: {two_node_cluster.job(job_id)}"
        time.sleep(0.2)
    assert time.monotonic() - stopped > timeout_s - 1, "the job failed before the process-group timeout"
    info = two_node_cluster.wait(job_id, timeout=300)

    restarts = int(info["Restarts"])
    node0 = node_logs(job_log(job_dir, job_id))[0]  # rank 0: its timeout, and the trainer's messages
    assert info["JobState"] == "COMPLETED" and restarts in (1, 2), node0
    first, second = first_and_last_attempts(node0, job_id, restarts)
    timed_out = rf"Timed out waiting {timeout_s * 1000}ms|{GLOO_PAIR_CLOSURE}"
    assert re.search(timed_out, first), first[-3000:]
    resumed = int(re.search(r"Restoring states from the checkpoint path at \S+?step=(\d+)", second)[1])
    assert resumed >= saved
    assert f"`Trainer.fit` stopped: `max_steps={max_steps}` reached." in second
    records = manifest(log_dir)
    assert {record["state"] for record in records} == {"complete"}
    assert {record["step"] for record in records} == set(range(10, max_steps + 1, 10)), "no checkpoint lost"
    for record in records:
        assert weights(log_dir, record["step"]), f"step {record['step']}: readable"


def test_preemption_signal_reaches_both_nodes_checkpoints_requeues_and_resumes(
    two_node_cluster: SlurmCluster, nemorun_home: Path, tmp_path: Path
) -> None:
    """2 nodes x 2 ranks: every rank of both nodes gets the signal, all four agree to save and stop."""
    log_dir, max_steps = tmp_path / "runs", 40
    recipe = tiny(log_dir, nodes=2, max_steps=max_steps, every=10, ranks_per_node=2)
    job_id, job_dir = submit(recipe, nodes=2, signal="USR1@60")
    wait_for_checkpoint(two_node_cluster, job_id, log_dir)

    subprocess.run(["scancel", "--signal=USR1", job_id], check=True)  # torchrun and workers on node0 and node1
    info = two_node_cluster.wait(job_id, timeout=300)

    logs = node_logs(job_log(job_dir, job_id))
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", logs
    assert attempts(logs[0], job_id).keys() == {1, 2}, logs[0]
    first, second = attempts(logs[0], job_id).values()  # global rank 0 saves, logs and requeues
    step = int(re.search(r"Received SIGUSR1: saved \S+ at step (\d+);", first)[1])
    assert 10 <= step < max_steps - 10, "the signal arrived mid-training"
    assert f"Requeueing Slurm job {job_id} to resume from step {step}" in first
    shards = sorted(p.name for p in (checkpoint_of(log_dir, step) / "weights").glob("*.distcp"))
    writers = {int(name.split("_")[2]) for name in shards}
    assert writers & {0, 1} and writers & {2, 3}, f"both nodes' ranks (0, 1 on node0; 2, 3 on node1) write: {shards}"
    assert f"Restoring states from the checkpoint path at {checkpoint_of(log_dir, step)}" in second
    assert "Received SIGUSR1" not in second
    assert f"`Trainer.fit` stopped: `max_steps={max_steps}` reached." in second
    assert logged_steps(log_dir) == list(range(step, max_steps)), "the requeued job resumes at the saved step"
    assert [record["step"] for record in manifest(log_dir)][-1] == max_steps
    attempts_by_node = {
        node: re.findall(rf"Slurm job {job_id}: attempt (\d+) on node{node}", log) for node, log in logs.items()
    }
    assert attempts_by_node == {0: ["1", "2"], 1: ["1", "2"]}, "both nodes ran both attempts"
    shown = nemo("experiment", "logs", "tiny", "0")  # NeMo-Run's own view of the job: both attempts, both nodes
    assert sorted(re.findall(rf"\b(\d): [^\n]*?Slurm job {job_id}: attempt (\d+)", shown)) == [
        ("0", "1"),
        ("0", "2"),
        ("1", "1"),
        ("1", "2"),
    ]


def test_killed_node_fails_the_job_and_the_requeue_resumes_when_it_is_back(
    two_node_cluster: SlurmCluster, nemorun_home: Path, tmp_path: Path
) -> None:
    """node1 killed outright (`cluster.sh kill-node`: its slurmd, slurmstepd, torchrun and rank): node0's rank fails in
    its next collective (node1's sockets are reset; without a reset, after the process-group timeout T), and whatever
    node0 does, slurmctld marks node1 DOWN and requeues the job (NeMo-Run submits with `--requeue`; `retries` would
    requeue it if srun gave up first). The job waits for node1, then resumes from the last complete checkpoint.

    The first attempt ends within 60 s of the kill (= T): node1 is DOWN 25-40 s after it (cluster.sh: SlurmdTimeout=20
    plus a ping round of MessageTimeout=10; measured 34-37 s), with slack for the loaded machine. `retries=2` as in
    the hung-rank test. What is checked survives the kill: node0's log (node1's last lines die with it, and an attempt
    cut short may leave no line on either node) and Slurm's own record of the job (restarts, nodes)."""
    timeout_s, max_steps, every = 60, 20, 5
    log_dir = tmp_path / "runs"
    recipe = tiny(log_dir, nodes=2, max_steps=max_steps, every=every)
    recipe.trainer.strategy.timeout = run.Config(timedelta, seconds=timeout_s)
    job_id, job_dir = submit(recipe, nodes=2, retries=2)
    saved = wait_for_checkpoint(two_node_cluster, job_id, log_dir)

    killed = time.monotonic()
    try:
        kill = cluster_sh("kill-node", str(two_node_cluster.dir), "1", timeout=60)
        assert kill.returncode == 0, kill.stderr
        while two_node_cluster.job(job_id)["Restarts"] == "0":
            assert time.monotonic() - killed < timeout_s, f"still running: {two_node_cluster.job(job_id)}"
            time.sleep(0.2)
    finally:
        start = cluster_sh("start-node", str(two_node_cluster.dir), "1", timeout=120)
    assert start.returncode == 0, start.stderr
    info = two_node_cluster.wait(job_id, timeout=300)

    node0 = node_logs(job_log(job_dir, job_id))[0]  # the surviving node's: node1's lines may be lost with it
    restarts = int(info["Restarts"])
    assert info["JobState"] == "COMPLETED" and restarts in (1, 2), node0
    assert info["NodeList"] == "node[0-1]", "the requeued job ran on both nodes, node1 back"
    first, second = first_and_last_attempts(node0, job_id, restarts)
    lost = rf"gloo/transport/tcp|{GLOO_PAIR_CLOSURE}"
    assert re.search(lost, first), f"node0's rank fails on the lost connection: {first[-3000:]}"
    assert f"`max_steps={max_steps}` reached" not in first, "node1 was killed mid-training"
    resumed = int(re.search(r"Restoring states from the checkpoint path at \S+?step=(\d+)", second)[1])
    assert resumed >= saved
    assert f"`Trainer.fit` stopped: `max_steps={max_steps}` reached." in second
    records = manifest(log_dir)
    assert {record["state"] for record in records} == {"complete"}
    assert {record["step"] for record in records} == set(range(every, max_steps + 1, every)), "no checkpoint lost"
    for record in records:
        assert weights(log_dir, record["step"]), f"step {record['step']}: readable"
