"""A `run_distributed` body: train the tiny GPT with LoRA adapters on a plain Trainer (kept in its own module so
spawned ranks import little)."""

import lightning.pytorch as pl

from nemo_ckpt.checkpoint.resume import RestoreCallback, RestoreConfig
from nemo_ckpt.data import MockDataModule
from nemo_ckpt.models import GPTModel, gpt_config
from nemo_ckpt.optim import OptimizerConfig
from nemo_ckpt.parallel.ddp_config import DistributedDataParallelConfig
from nemo_ckpt.peft import LoRA
from nemo_ckpt.strategy import MegatronStrategy
from tests.helpers.trainer import RecordLoss, build_trainer

GLOBAL_BATCH_SIZE = 4


def train_lora(rank: int, world_size: int, sharding: str, max_steps: int, base: str) -> list[float]:
    """Per-step losses of LoRA(dim=4) on every linear layer of the tiny GPT restored from the checkpoint `base`,
    data parallel under `sharding`."""
    return fit_lora(world_size, sharding, max_steps, base)[0]


def train_lora_tensor_parallel(rank: int, world_size: int, max_steps: int, base: str) -> tuple[list[float], dict]:
    """`train_lora` with tensor_model_parallel_size=world_size; also each adapter's placement and local shape."""
    losses, model = fit_lora(world_size, "no_shard", max_steps, base, tensor_parallel=world_size)
    placements = {
        name.removeprefix("module."): (repr(param.placements[0]), tuple(param.to_local().shape))
        for name, param in model.named_parameters()
        if param.requires_grad
    }
    return losses, placements


def fit_lora(
    world_size: int, sharding: str, max_steps: int, base: str, tensor_parallel: int = 1
) -> tuple[list[float], GPTModel]:
    """Train LoRA on a plain Trainer; returns the per-step losses and the trained model."""
    pl.seed_everything(1234, verbose=False)
    config = gpt_config("tiny")
    recorder = RecordLoss()
    trainer = build_trainer(
        MegatronStrategy(
            tensor_model_parallel_size=tensor_parallel,
            ddp=DistributedDataParallelConfig(data_parallel_sharding_strategy=sharding),
        ),
        devices=world_size,
        max_steps=max_steps,
        callbacks=[recorder, RestoreCallback(RestoreConfig(path=base))],
    )
    model = GPTModel(config, OptimizerConfig(lr=1e-2, lr_warmup_steps=0), peft=LoRA(dim=4, alpha=8))
    data = MockDataModule(
        seq_length=config.seq_length,
        vocab_size=config.vocab_size,
        micro_batch_size=GLOBAL_BATCH_SIZE * tensor_parallel // world_size,
        global_batch_size=GLOBAL_BATCH_SIZE,
    )
    trainer.fit(model, datamodule=data)
    return recorder.losses, model
