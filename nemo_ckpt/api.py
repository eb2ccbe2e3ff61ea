"""`pretrain` and `finetune`: the entry points a recipe's `run.Partial` targets, like NeMo's `llm.pretrain` and
`llm.finetune`; `import_ckpt` / `export_ckpt` convert checkpoints (Hugging Face, Megatron-Core naming); `evaluate`:
a checkpoint's loss and perplexity on an indexed dataset or SFT records (`nemo_ckpt.inference.evaluate`);
`generate`: text from a checkpoint (`nemo_ckpt.inference`)."""

import dataclasses
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist

from nemo_ckpt.checkpoint import context
from nemo_ckpt.checkpoint.resume import AutoResume, RestoreCallback, RestoreConfig, restore_artifacts
from nemo_ckpt.checkpoint.rng import RNGStateCallback
from nemo_ckpt.conversion import export_ckpt, import_ckpt
from nemo_ckpt.data.base import SampledDataModule
from nemo_ckpt.inference.evaluate import evaluate
from nemo_ckpt.inference.parallel import load_generation_model
from nemo_ckpt.inference.sampling import SamplingParams
from nemo_ckpt.inference.text import end_token_ids, generate_text, load_tokenizer
from nemo_ckpt.logger import NeMoLogger
from nemo_ckpt.models.gpt.lightning import GPTModel
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
    model, ckpt_path = resolve_start(model, data, log, resume, getattr(trainer.strategy, "ckpt_load_optimizer", True))
    if isinstance(resume.restore_config, RestoreConfig):  # start from its weights unless this run resumes
        trainer.callbacks.append(RestoreCallback(resume.restore_config, resuming=ckpt_path is not None))
    if optim is not None:
        context.set_init_arg(model, "optim", optim)
    run_config = {"model": model, "data": data, "trainer": trainer, "log": log, "resume": resume, "seed": seed}
    log.setup(trainer, task_config=run_config)
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    return log.checkpoint_dir


def resolve_start(
    model: pl.LightningModule,
    data: pl.LightningDataModule,
    log: NeMoLogger,
    resume: AutoResume,
    load_optimizer: bool = True,
) -> tuple[pl.LightningModule, Path | None]:
    """What a run starts from, decided before any process group exists (so `nemo_ckpt.preflight` can check it
    before launching): the checkpoint it resumes (`AutoResume.find_checkpoint`, with the strategy's
    `ckpt_load_optimizer`); the data tokenizing with a `RestoreConfig` checkpoint's tokenizer
    (`restore_artifacts`); the model, rebuilt from the resumed checkpoint with `restore_config=True`, with the
    vocabulary of the data's tokenizer (`GPTConfig.vocab_size=None`, padded up to `make_vocab_size_divisible_by`;
    a set size smaller than the tokenizer's is a `VocabularyError`)."""
    ckpt_path = resume.find_checkpoint(log.checkpoint_dir, load_optimizer, writes_checkpoints=log.ckpt is not None)
    if isinstance(resume.restore_config, RestoreConfig):
        restore_artifacts(resume.restore_config, data)
    model = resume.restore_model(ckpt_path, model)
    if isinstance(model, GPTModel) and isinstance(data, SampledDataModule):
        model.use_vocabulary(data.vocab_size, data.vocab_source)
    return model, ckpt_path


def restore_config_of(resume: AutoResume) -> RestoreConfig:
    """The `RestoreConfig` fine-tuning starts from, checked to name a complete checkpoint."""
    if not isinstance(resume.restore_config, RestoreConfig):
        raise ValueError(
            "finetune needs the weights to start from: pass resume=AutoResume(restore_config=RestoreConfig("
            "path=<checkpoint or imported model>)) (import a Hugging Face model with nemo_ckpt.api.import_ckpt)"
        )
    resume.restore_config.check()
    return resume.restore_config


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
    restore_path = restore_config_of(resume).check()
    if peft is not None:
        if getattr(peft, "base_checkpoint", "") is None:
            peft = dataclasses.replace(peft, base_checkpoint=str(restore_path.resolve()))
        context.set_init_arg(model, "peft", peft)
    return pretrain(model, data, trainer, log, resume, optim, seed)


def generate(
    path: str,
    prompts: list[str],
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop: list[str] | None = None,
    chat: bool = False,
    stream: bool = True,
    device: str = "cpu",
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
) -> list[str]:
    """The text the checkpoint at `path` generates after each of `prompts`, with its stored tokenizer.

    Any checkpoint: pretrained, fine-tuned, imported, or LoRA (its adapters applied to the base without merging),
    whatever layout saved it. Greedy with `temperature=0`, else sampled (`top_k`, `top_p`, `seed`: see
    `nemo_ckpt.inference.sampling.SamplingParams`); a row ends after `max_new_tokens`, at the tokenizer's eos, or
    at one of the `stop` strings (cut before it). `chat`: each prompt is a user turn through the tokenizer's chat
    template. `stream`: each prompt's text is printed as it is produced, one prompt after another (as
    `nemo nemo_ckpt generate` shows it); `stream=False` generates the prompts in one batch and prints nothing.
    `device`: `cpu` or `cuda`. `tensor_parallel_size` / `pipeline_parallel_size`: the model split over that many
    processes, each reading its part of the checkpoint (start them with torchrun, e.g. `torchrun
    --nproc-per-node 2 $(which nemo) nemo_ckpt generate ... tensor_parallel_size=2`); the first one prints.
    """
    tokenizer = load_tokenizer(path)
    params = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        stop_token_ids=end_token_ids(tokenizer, path),
        stop_strings=tuple(stop or ()),
    )
    model = load_generation_model(path, tensor_parallel_size, pipeline_parallel_size, device)
    out = sys.stdout if not dist.is_initialized() or dist.get_rank() == 0 else None
    return generate_text(model, tokenizer, list(prompts), params, chat, stream, out)


__all__ = ["evaluate", "export_ckpt", "finetune", "generate", "import_ckpt", "pretrain"]
