"""Checks of a `pretrain` / `finetune` task that need no processes, run before anything is launched.

`check_task(task)` builds the parts of a recipe that are cheap to build (data module with its tokenizer and
datasets, model, logger, resume settings; not the Trainer) and decides what the run would start from exactly as
`pretrain` does (`nemo_ckpt.api.resolve_start`): so unknown options, missing paths, a bad tokenizer, a resume or
restore path that is not a complete checkpoint, a checkpoint directory it cannot resume or that another run is
writing (its writer lock), and a model vocabulary
smaller than the tokenizer's fail here, named, instead of minutes later on every rank. The `nemo` command line runs
it before it starts torchrun or submits a job.
"""

from typing import Any

import fiddle as fdl

from nemo_ckpt.api import finetune, resolve_start, restore_config_of
from nemo_ckpt.checkpoint.lock import DirectoryLock
from nemo_ckpt.checkpoint.resume import AutoResume
from nemo_ckpt.logger import NeMoLogger
from nemo_ckpt.options import check_config_options
from nemo_ckpt.parallel.mesh import PARALLEL_SIZE_OPTIONS, ParallelDims
from nemo_ckpt.parallel.pipeline import PipelineConfig

USER_ERRORS = (ValueError, TypeError, KeyError, OSError, RuntimeError)


class PreflightError(ValueError):
    """A task that cannot run, found before launching it; the message names the key and the fix."""


def check_task(task: fdl.Buildable) -> None:
    """Raise `PreflightError` for the first problem of `task` (a `run.Partial` of `pretrain` or `finetune`)."""
    try:
        check_config_options(task)
    except USER_ERRORS as error:
        raise PreflightError(str(error)) from error
    dims = _check_trainer(_argument(task, "trainer"))
    strategy = _argument(_argument(task, "trainer"), "strategy")
    model, data = _build(task, "model"), _build(task, "data")
    if dims is not None and data is not None:
        _check_batch(dims, strategy, data)
    log = _build(task, "log") or NeMoLogger()
    resume = _build(task, "resume") or AutoResume()
    load_optimizer = _argument(strategy, "ckpt_load_optimizer", True)
    try:
        if log.ckpt is not None:
            DirectoryLock(log.checkpoint_dir).check_free()
        if fdl.get_callable(task) is finetune:
            restore_config_of(resume)
        if model is not None and data is not None:
            resolve_start(model, data, log, resume, load_optimizer)
    except USER_ERRORS as error:
        raise PreflightError(_message(error)) from error


def _check_trainer(trainer: Any) -> ParallelDims | None:
    """The Trainer's step limit and size, and its strategy's parallel sizes against that size (`ParallelDims`,
    returned; None where the size is known only once the processes start), read from the config: building a
    Trainer here would set up devices in this process."""
    if not isinstance(trainer, fdl.Buildable):
        return None
    max_steps = _argument(trainer, "max_steps", -1)
    if not isinstance(max_steps, int) or isinstance(max_steps, bool) or max_steps < -1 or max_steps == 0:
        raise PreflightError(f"trainer.max_steps={max_steps!r}: use a positive number of steps (or -1: no limit)")
    sizes = {name: _argument(trainer, name, 1) for name in ("num_nodes", "devices")}
    for name, value in sizes.items():
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise PreflightError(f"trainer.{name}={value}: use 1 or more")
    if not all(isinstance(value, int) for value in sizes.values()):
        return None  # devices="auto" and such: known once the processes start
    strategy = _argument(trainer, "strategy")
    given = {dim: _argument(strategy, option, 1) for dim, option in PARALLEL_SIZE_OPTIONS.items()}
    try:
        return ParallelDims(sizes["num_nodes"] * sizes["devices"], **given)
    except (ValueError, TypeError) as error:
        raise PreflightError(
            f"trainer.strategy: {error} (trainer.num_nodes={sizes['num_nodes']} x trainer.devices={sizes['devices']})"
        ) from error


def _check_batch(dims: ParallelDims, strategy: Any, data: Any) -> None:
    """The global batch against micro-batch x data-parallel size, and the micro-batches per step against the
    pipeline schedule, as the data module's setup and the strategy would find them on every rank."""
    micro, global_batch = getattr(data, "micro_batch_size", None), getattr(data, "global_batch_size", None)
    if not isinstance(micro, int):
        return
    per_step = micro * dims.dp
    global_batch = per_step if global_batch is None else global_batch
    if global_batch % per_step:
        raise PreflightError(
            f"data.global_batch_size={global_batch} must be a multiple of data.micro_batch_size x data-parallel "
            f"size = {micro} x {dims.dp}"
        )
    if dims.pp == 1:
        return
    try:
        PipelineConfig(
            dims.pp,
            _argument(strategy, "virtual_pipeline_model_parallel_size"),
            schedule=_argument(strategy, "pipeline_schedule"),
        ).validate_microbatches(global_batch // per_step)
    except ValueError as error:
        raise PreflightError(f"data.global_batch_size={global_batch}: {error}") from error


def _argument(config: Any, name: str, default: Any = None) -> Any:
    if not isinstance(config, fdl.Buildable):
        return default
    return getattr(config, name, default)


def _build(task: fdl.Buildable, key: str) -> Any:
    """`task.<key>` built (None if the task does not set it), its errors named by `key`."""
    config = _argument(task, key)
    if not isinstance(config, fdl.Buildable):
        return config
    try:
        return fdl.build(config)
    except USER_ERRORS as error:
        raise PreflightError(f"{key}: {_message(error)}") from error


def _message(error: BaseException) -> str:
    """The error's own message, without the config path Fiddle appends to errors raised while building."""
    message = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
    return str(message).split("\n\nFiddle context:", 1)[0]
