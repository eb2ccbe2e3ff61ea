"""The `nemo nemo_ckpt ...` command line: the `pretrain` entry point, its recipes and executors in NeMo-Run.

nemo nemo_ckpt pretrain --factory tiny trainer.max_steps=20 run.executor=local --yes
nemo nemo_ckpt pretrain --factory tiny run.executor=slurm run.executor.account=llm --dryrun
nemo nemo_ckpt pretrain --factory tiny trainer.max_steps=20 --to-yaml recipe.yaml   (export, run nothing)
nemo nemo_ckpt pretrain --yaml overrides.yaml run.executor=local --yes   (`run: {factory: tiny}` + overrides)
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import nemo_run as run
from nemo_run.cli.api import RunContext

import launch.local  # noqa: F401  (registers the `local` executor factory)
import recipes  # noqa: F401  (registers the recipe factories of `pretrain`)
from launch.slurm import check_job, check_layout, sbatch_script
from nemo_ckpt.api import export_ckpt, finetune, import_ckpt, pretrain
from nemo_ckpt.options import check_override


@dataclass(kw_only=True)
class DryRunShowsScript(RunContext):
    """NeMo-Run's run context; with a Slurm executor, `--dryrun` also prints the sbatch script it would submit,
    and the recipe is checked against the executor before anything is submitted (`launch.slurm.check_job`; with
    `--dryrun` only `check_layout`, which needs no cluster)."""

    task: run.Partial | None = field(init=False, default=None)

    def parse_fn(self, fn: Callable, args: list[str], **default_args) -> run.Partial:
        try:
            self.task = super().parse_fn(fn, args, **default_args)
        except Exception:
            # name a misspelt or unsupported option with a suggestion, rather than NeMo-Run's parse error
            base = super().parse_fn(fn, [], **default_args)
            for key in (arg.split("=", 1)[0].rstrip("+-*/") for arg in args if "=" in arg):
                check_override(base, key)
            raise
        if isinstance(self.executor, run.SlurmExecutor) and not any((self.to_yaml, self.to_toml, self.to_json)):
            if self.dryrun:
                check_layout(self.task, self.executor)
            else:
                check_job(self.task, self.executor)
        return self.task

    def parse_executor(self, name: str, *args: str) -> run.Partial:
        try:
            return super().parse_executor(name, *args)
        except Exception:
            # `run.executor.ntasks_per_nod=2`: name the closest option, rather than NeMo-Run's parse error
            base = super().parse_executor(name)
            for key in (arg.split("=", 1)[0].rstrip("+-*/") for arg in args if "=" in arg):
                check_override(base, key)
            raise

    def cli_execute(self, fn: Callable, args: list[str], entrypoint_type: Literal["task", "experiment"] = "task"):
        super().cli_execute(fn, args, entrypoint_type)
        if self.dryrun and isinstance(self.executor, run.SlurmExecutor):
            print(sbatch_script(self.task, self.executor, name=self.name))


run.cli.entrypoint(pretrain, namespace="nemo_ckpt", run_ctx_cls=DryRunShowsScript)
run.cli.entrypoint(finetune, namespace="nemo_ckpt", run_ctx_cls=DryRunShowsScript)
run.cli.entrypoint(import_ckpt, namespace="nemo_ckpt", enable_executor=False)
run.cli.entrypoint(export_ckpt, namespace="nemo_ckpt", enable_executor=False)
