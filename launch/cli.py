"""The `nemo nemo_ckpt ...` command line: the `pretrain` and `finetune` entry points, their recipes and executors in
NeMo-Run.

nemo nemo_ckpt pretrain --factory tiny trainer.max_steps=20 run.executor=local --yes
nemo nemo_ckpt pretrain --factory tiny run.executor=slurm run.executor.account=llm --dryrun
nemo nemo_ckpt pretrain --factory tiny trainer.max_steps=20 --to-yaml recipe.yaml   (export, run nothing)
nemo nemo_ckpt pretrain --yaml overrides.yaml run.executor=local --yes   (`run: {factory: tiny}` + overrides)

Exit status: 0 the job succeeded (a Slurm job with `--detach`: was submitted); 1 it failed (`error: ...` on stderr);
2 the command was refused before anything was launched (`error: <what to fix>` on stderr: an unknown option, a
missing path, a recipe that does not fit the executor, ...); 128 + N a local run stopped by signal N (`launch.job`).
"""

import logging
import re
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal, NoReturn

import nemo_run as run
import typer
from nemo_run.cli.api import RunContext
from nemo_run.cli.cli_parser import CLIException, ParseError

import launch.local  # noqa: F401  (registers the `local` executor factory)
import recipes  # noqa: F401  (registers the recipe factories of `pretrain`)
from launch.job import run_and_wait
from launch.slurm import SlurmPathWarning, check_job, check_layout, sbatch_script
from nemo_ckpt._compat import nemo_run_cli_split_run_args
from nemo_ckpt.api import evaluate, export_ckpt, finetune, generate, import_ckpt, pretrain
from nemo_ckpt.options import UnknownOptionError, check_config_options, check_override
from nemo_ckpt.preflight import check_task

REFUSED = 2
USER_ERRORS = (ValueError, FileNotFoundError, UnknownOptionError, CLIException)  # PreflightError: a ValueError


_CONTEXT = re.compile(r" \(Argument: [^()\n]*, Context: \{[^{}\n]*\}\)")  # what NeMo-Run's parse errors append


class OverrideError(ValueError):
    """A command-line override that NeMo-Run cannot apply, named with the reason."""


def refuse(error: BaseException) -> NoReturn:
    """Print `error: <message>` on stderr (without the config path Fiddle appends, or the recipe NeMo-Run's parse
    errors carry) and exit 2."""
    message = reason(error) if isinstance(error, CLIException) else str(error).split("\n\nFiddle context:", 1)[0]
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(REFUSED)


def reason(error: BaseException) -> str:
    """What NeMo-Run's parse error says, without the recipe it appends: of the innermost of its chained errors (or
    the first that is not NeMo-Run's), the first line, without `(Argument: ..., Context: ...)`."""
    while isinstance(error, CLIException) and error.__cause__ is not None:
        error = error.__cause__
    if isinstance(error, ParseError) and isinstance(error.value, str):
        kind = getattr(error.expected_type, "__name__", error.expected_type)
        text = f"cannot parse {error.value!r} as {kind}: {error.reason}"
    else:
        text = str(error).split(" (Argument: ", 1)[0]
    return _CONTEXT.sub("", text).splitlines()[0]


def check_keys(args: Sequence[str]) -> None:
    """Refuse an override whose dotted key has an empty name (`trainer..max_steps=5`), which NeMo-Run would not
    apply where it was meant to go."""
    for arg in args:
        key = arg.split("=", 1)[0].rstrip("+-*/|&") if "=" in arg else ""
        if key and "" in key.split("."):
            fixed = ".".join(part for part in key.split(".") if part)
            raise OverrideError(f"{arg}: the key {key!r} has an empty name between dots; did you mean {fixed!r}?")


def explain(parse: Callable[[list[str]], object], args: tuple[str, ...] | list[str], error: Exception) -> NoReturn:
    """Raise what is wrong with the overrides `args` that `parse` failed on with `error`: a misspelt or unsupported
    option (`check_override`, with the closest name, each level of a dotted key), else the first override that does
    not parse, named, with NeMo-Run's reason."""
    with quiet_nemo_run():
        base = parse([])
    for key in (arg.split("=", 1)[0].rstrip("+-*/|&") for arg in args if "=" in arg):
        parts = key.split(".")
        for depth in range(1, len(parts) + 1):
            if not parts[depth - 1].isidentifier():  # `callbacks[0]`: an item, not an option
                break
            check_override(base, ".".join(parts[:depth]))
    for end in range(1, len(args) + 1):
        try:
            with quiet_nemo_run():
                parse(list(args[:end]))
        except Exception as failure:
            raise OverrideError(f"{args[end - 1]}: {reason(failure)}") from error
    raise error


@contextmanager
def quiet_nemo_run() -> Iterator[None]:
    """Keep NeMo-Run's parse errors (logged with the whole recipe, 70 lines) off the console: they are re-raised,
    and `refuse` says what to fix."""
    logger = logging.getLogger("nemo_run")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def runs_here(executor: run.Executor | None) -> bool:
    """Whether the executor's processes see this machine's files at the paths the recipe names: a local run, or a
    Slurm job submitted with the local `sbatch` without a container (a shared file system)."""
    if isinstance(executor, run.SlurmExecutor):
        return isinstance(executor.tunnel, run.LocalTunnel) and not executor.container_image
    return True


@dataclass(kw_only=True)
class CheckedRunContext(RunContext):
    """NeMo-Run's run context, checking before it launches and telling how the job ended.

    Before anything is launched (also with `--dryrun`): the overrides are parsed (a misspelt or unsupported option
    names the closest one), `nemo_ckpt.preflight.check_task` builds the cheap parts of the recipe (data, tokenizer,
    paths, resume), and with a Slurm executor the recipe is checked against it (`launch.slurm.check_job`; with
    `--dryrun` only `check_layout`, which needs no cluster). A failed check prints `error: <message>` and exits 2. A
    launched job runs through `launch.job.run_and_wait`: the exit status is the job's, and Ctrl-C stops a local run
    with a checkpoint. With a Slurm executor, `--dryrun` also prints the sbatch script it would submit.
    """

    task: run.Partial | None = field(init=False, default=None)

    def parse_fn(self, fn: Callable, args: list[str], **default_args) -> run.Partial:
        check_keys(args)
        try:
            with quiet_nemo_run():
                return super().parse_fn(fn, args, **default_args)
        except Exception as error:
            explain(lambda some: super(CheckedRunContext, self).parse_fn(fn, some, **default_args), args, error)

    def parse_executor(self, name: str, *args: str) -> run.Partial:
        check_keys(args)
        try:
            with quiet_nemo_run():
                return super().parse_executor(name, *args)
        except Exception as error:
            explain(lambda some: super(CheckedRunContext, self).parse_executor(name, *some), args, error)

    def cli_execute(self, fn: Callable, args: list[str], entrypoint_type: Literal["task", "experiment"] = "task"):
        if entrypoint_type != "task" or self.repl or self.load or any((self.to_yaml, self.to_toml, self.to_json)):
            try:
                super().cli_execute(fn, args, entrypoint_type)  # an export, or what NeMo-Run does alone
            except USER_ERRORS as error:
                refuse(error)
            return
        try:
            run_args, task_args = nemo_run_cli_split_run_args(args)
            with quiet_nemo_run():
                self.parse_args(run_args)
            self.task = self.parse_fn(fn, task_args)
            self.check(fn)
        except USER_ERRORS as error:
            refuse(error)
        run.dryrun_fn(self.task, executor=self.executor)
        if self.dryrun:
            print(f"Dry run for {self.name}")
            if isinstance(self.executor, run.SlurmExecutor):
                print(sbatch_script(self.task, self.executor, name=self.name))
            return
        if not (self.skip_confirmation or typer.confirm("Continue?")):
            print("Exiting...")
            return
        print(f"Launching {self.name}...")
        if self.direct or self.executor is None:
            run.run(self.task, name=self.name, direct=True)
            return
        status = run_and_wait(self.task, self.executor, self.name, self.plugins, detach=self.detach)
        if status:
            sys.exit(status)

    def check(self, fn: Callable) -> None:
        """What can be checked before launching: the task (`check_task` where the executor's processes see this
        machine's files, else its options only) and, with a Slurm executor, the recipe against it, whose warnings
        (`SlurmPathWarning`) are printed as `warning: ...` on stderr."""
        if fn in (pretrain, finetune) and runs_here(self.executor):
            check_task(self.task)
        elif fn in (pretrain, finetune):
            check_config_options(self.task)
        if not isinstance(self.executor, run.SlurmExecutor):
            return
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", SlurmPathWarning)
            try:
                (check_layout if self.dryrun else check_job)(self.task, self.executor)
            finally:
                for warning in caught:
                    if issubclass(warning.category, SlurmPathWarning):
                        print(f"warning: {warning.message}", file=sys.stderr, flush=True)
                    else:
                        warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)


run.cli.entrypoint(pretrain, namespace="nemo_ckpt", run_ctx_cls=CheckedRunContext)
run.cli.entrypoint(finetune, namespace="nemo_ckpt", run_ctx_cls=CheckedRunContext)
run.cli.entrypoint(import_ckpt, namespace="nemo_ckpt", enable_executor=False)
run.cli.entrypoint(export_ckpt, namespace="nemo_ckpt", enable_executor=False)
run.cli.entrypoint(evaluate, namespace="nemo_ckpt", enable_executor=False)
run.cli.entrypoint(generate, namespace="nemo_ckpt", enable_executor=False)
