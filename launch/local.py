"""Local executor: torchrun on this machine, N processes."""

import nemo_run as run


@run.cli.factory(name="local")
@run.autoconvert
def local_executor(ntasks_per_node: int = 2, env_vars: dict[str, str] | None = None) -> run.LocalExecutor:
    """Run the task under `torchrun --nproc-per-node ntasks_per_node` (gloo on CPU, NCCL on GPU)."""
    return run.LocalExecutor(ntasks_per_node=ntasks_per_node, launcher="torchrun", env_vars=env_vars or {})
