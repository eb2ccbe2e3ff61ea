"""`pretrain` and `finetune`: the entry points a recipe's `run.Partial` targets, like NeMo's `llm.pretrain` and
`llm.finetune`; `import_ckpt` / `export_ckpt` convert checkpoints (Hugging Face, Megatron-Core naming)."""

import dataclasses
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from nemo_ckpt.checkpoint import context
from nemo_ckpt.checkpoint.resume import AutoResume, RestoreCallback, RestoreConfig, restore_artifacts
from nemo_ckpt.checkpoint.rng import RNGStateCallback
from nemo_ckpt.conversion import export_ckpt, import_ckpt
from nemo_ckpt.logger import NeMoLogger
from nemo_ckpt.optim import OptimizerConfig


def pretrain(
    model: pl.LightningModule,
    data: pl.LightningDataModule,
    trainer: pl.Trainer,
    log: NeMoLogger | None = None,
    resume: AutoResume | None = None,
    optim: OptimizerConfig | None = None,
    seed: int = 1234,
) -> Path:
    """Train `model` on `data`, resuming as `resume` says; return the checkpoint directory.

    Every rank seeds its random generators with `seed`, so ranks build identical models and runs repeat; a
    resumed run continues with the generator states saved in its checkpoint. With
    `AutoResume(restore_config=True)` the model is rebuilt from the checkpoint's stored config; `optim` still
    applies to it. With `AutoResume(restore_config=RestoreConfig(path))`, a run with nothing to resume starts
    from that checkpoint's weights.
    """
    pl.seed_everything(seed, workers=True, verbose=False)
    log = log or NeMoLogger()
    resume = resume or AutoResume()
    if not any(isinstance(callback, RNGStateCallback) for callback in trainer.callbacks):
        trainer.callbacks.append(RNGStateCallback())
    ckpt_path = resume.find_checkpoint(log.checkpoint_dir)
    if isinstance(resume.restore_config, RestoreConfig):  # start from its weights unless this run resumes
        trainer.callbacks.append(RestoreCallback(resume.restore_config, resuming=ckpt_path is not None))
        restore_artifacts(resume.restore_config, data)
    model = resume.restore_model(ckpt_path, model)
    if optim is not None:
        context.set_init_arg(model, "optim", optim)
    run_config = {"model": model, "data": data, "trainer": trainer, "log": log, "resume": resume, "seed": seed}
    log.setup(trainer, task_config=run_config)
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    return log.checkpoint_dir


def finetune(
    model: pl.LightningModule,
    data: pl.LightningDataModule,
    trainer: pl.Trainer,
    log: NeMoLogger | None = None,
    resume: AutoResume | None = None,
    optim: OptimizerConfig | None = None,
    peft: Any = None,
    seed: int = 1234,
) -> Path:
    """Fine-tune `model` from the weights of `resume.restore_config` (a `RestoreConfig`: an imported Hugging Face
    model or another checkpoint), with a fresh optimizer at step 0; return the checkpoint directory.

    With `peft` (e.g. `nemo_ckpt.peft.LoRA(...)`) only adapters train and are checkpointed, pointing at the
    restored checkpoint. `resume_if_exists` still resumes the fine-tuning run itself after a crash.
    """
    log = log or NeMoLogger()
    resume = resume or AutoResume()
    if not isinstance(resume.restore_config, RestoreConfig):
        raise ValueError(
            "finetune needs the weights to start from: pass resume=AutoResume(restore_config=RestoreConfig("
            "path=<checkpoint or imported model>)) (import a Hugging Face model with nemo_ckpt.api.import_ckpt)"
        )
    restore_path = resume.restore_config.check()
    if peft is not None:
        if getattr(peft, "base_checkpoint", "") is None:
            peft = dataclasses.replace(peft, base_checkpoint=str(restore_path.resolve()))
        context.set_init_arg(model, "peft", peft)
    return pretrain(model, data, trainer, log, resume, optim, seed)


__all__ = ["export_ckpt", "finetune", "import_ckpt", "pretrain"]
