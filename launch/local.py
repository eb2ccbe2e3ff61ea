"""Local executor: torchrun on this machine, N processes.

From Python, `local_executor(...)` returns the executor itself:
`run.run(recipe, executor=local_executor(ntasks_per_node=2))`. On the command line the `local` factory
selects it: `run.executor=local run.executor.ntasks_per_node=2`; the overrides are `local_executor`'s
arguments, validated when the executor is built.

Ctrl-C or SIGTERM to `nemo` stops the run (`launch.job`): torchrun forwards SIGTERM to the ranks, which save a
checkpoint at the end of their step and exit; torchrun kills those still running after its shutdown timeout
(`TORCH_ELASTIC_SHUTDOWN_TIMEOUT`, default 30 s: `env_vars={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "300"}` for a large
final checkpoint).
"""

import re
import shutil
import sys
from pathlib import Path

import nemo_run as run

from nemo_ckpt.logger.text_log import launcher_env

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def local_executor(ntasks_per_node: int = 2, env_vars: dict[str, str] | None = None) -> run.LocalExecutor:
    """Run the task under `torchrun --nproc-per-node ntasks_per_node` (gloo on CPU, NCCL on GPU)."""
    errors = []
    if not isinstance(ntasks_per_node, int) or ntasks_per_node < 1:
        errors.append(f"ntasks_per_node must be an integer >= 1, got {ntasks_per_node!r}")
    errors += [
        f"env var name {name!r} is not a shell identifier" for name in env_vars or {} if not _ENV_NAME.match(name)
    ]
    if shutil.which("torchrun") is None:
        errors.append(
            f"torchrun is not on PATH; activate the environment that has torch (`. .venv/bin/activate`) "
            f"or add {Path(sys.executable).parent} to PATH"
        )
    if errors:
        raise ValueError("invalid local executor: " + "; ".join(errors))
    return run.LocalExecutor(
        ntasks_per_node=ntasks_per_node,
        launcher="torchrun",
        env_vars=launcher_env() | {k: str(v) for k, v in (env_vars or {}).items()},
    )


@run.cli.factory(name="local")
def local() -> run.Config[run.LocalExecutor]:
    """CLI factory: `run.executor=local run.executor.ntasks_per_node=2`; fields are `local_executor`'s arguments."""
    return run.Config(local_executor)
