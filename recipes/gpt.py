"""GPT pretraining recipes: a `run.Partial` of `nemo_ckpt.api.pretrain`, editable before it runs.

recipe = pretrain_recipe(name="demo", num_gpus_per_node=2)
recipe.trainer.max_steps = 20
recipe.trainer.strategy.save_ckpt_format = "torch_dist"
recipe.trainer.strategy.ddp.data_parallel_sharding_strategy = "optim_grads_params"
"""

import os

import lightning.pytorch as pl
import nemo_run as run

from nemo_ckpt.api import pretrain
from nemo_ckpt.checkpoint import AutoResume, ModelCheckpoint, PreemptionCallback
from nemo_ckpt.data import MockDataModule, PreTrainingDataModule
from nemo_ckpt.data.corpus import prepare_tiny_corpus
from nemo_ckpt.logger import NeMoLogger
from nemo_ckpt.models import GPTModel, gpt_config
from nemo_ckpt.optim import OptimizerConfig
from nemo_ckpt.parallel import DistributedDataParallelConfig
from nemo_ckpt.strategy import MegatronStrategy
from recipes.strict_config import StrictConfig


def ddp(data_parallel_sharding_strategy: str = "no_shard") -> run.Config[DistributedDataParallelConfig]:
    """NeMo's recipe defaults: NaN checks, fp32 gradient reduction, overlapped communication."""
    return StrictConfig(
        DistributedDataParallelConfig,
        data_parallel_sharding_strategy=data_parallel_sharding_strategy,
        check_for_nan_in_grad=True,
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=True,
        overlap_param_gather=data_parallel_sharding_strategy != "no_shard",
        average_in_collective=True,
    )


def trainer(
    num_nodes: int = 1,
    num_gpus_per_node: int = 2,
    max_steps: int = 20,
    val_check_interval: int = 10,
    data_parallel_sharding_strategy: str = "no_shard",
) -> run.Config[pl.Trainer]:
    """A Lightning Trainer on `MegatronStrategy`; `num_gpus_per_node` is the processes per node on CPU.

    `PreemptionCallback` checkpoints, stops and requeues the Slurm job on SIGUSR1 (`--signal=USR1@N`).
    """
    return StrictConfig(
        pl.Trainer,
        accelerator="auto",
        devices=num_gpus_per_node,
        num_nodes=num_nodes,
        strategy=StrictConfig(MegatronStrategy, ddp=ddp(data_parallel_sharding_strategy)),
        max_steps=max_steps,
        val_check_interval=val_check_interval,
        check_val_every_n_epoch=None,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        use_distributed_sampler=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        callbacks=[StrictConfig(PreemptionCallback)],
    )


def pretrain_recipe(
    name: str = "default",
    dir: str | None = None,
    num_nodes: int = 1,
    num_gpus_per_node: int = 2,
    model_size: str = "tiny",
    max_steps: int = 20,
    micro_batch_size: int = 4,
    global_batch_size: int | None = None,
    data: str | None = None,
    data_paths: list | None = None,
    tokenizer: str | None = None,
    seq_length: int | None = None,
) -> run.Partial:
    """Pretrain a GPT of `model_size`, checkpointing every 10 steps and resuming if it can.

    `data="mock"` (the default without `data_paths`): synthetic sequences. `data="real"` (the default with
    `data_paths`): Megatron indexed datasets `data_paths` (prefixes, or `[weight, prefix, ...]`) tokenized with
    `tokenizer`; without `data_paths`, a generated corpus prepared (once) under `<dir>/data/tiny_corpus` with its
    own BPE tokenizer. The model's vocabulary is the tokenizer's, padded to a multiple of 128
    (`model.config.vocab_size=None`). `global_batch_size=None`: one micro-batch per data-parallel rank.
    `seq_length`: of the model and the data (default: the preset's).
    """
    model = gpt_config(model_size, **({} if seq_length is None else {"seq_length": seq_length}))
    data = data or ("mock" if data_paths is None else "real")
    batch = {
        "seq_length": model.seq_length,
        "micro_batch_size": micro_batch_size,
        "global_batch_size": global_batch_size,
    }
    return run.Partial(
        pretrain,
        model=StrictConfig(GPTModel, config=StrictConfig(type(model), **{**vars(model), "vocab_size": None})),
        data=data_module(data, model.vocab_size, dir or "nemo_experiments", data_paths, tokenizer, **batch),
        trainer=trainer(num_nodes, num_gpus_per_node, max_steps),
        log=StrictConfig(
            NeMoLogger,
            name=name,
            log_dir=dir or "nemo_experiments",
            ckpt=StrictConfig(
                ModelCheckpoint, monitor="reduced_train_loss", save_top_k=2, save_last=True, every_n_train_steps=10
            ),
        ),
        resume=StrictConfig(AutoResume, resume_if_exists=True, resume_ignore_no_checkpoint=True),
        optim=StrictConfig(OptimizerConfig, lr=3e-3, min_lr=3e-4, lr_warmup_steps=2),
    )


def data_module(
    data: str, vocab_size: int, log_dir: str, data_paths: list | None, tokenizer: str | None, **batch
) -> run.Config:
    """The recipe's data: `MockDataModule` (ids below `vocab_size`) or `PreTrainingDataModule` (see
    `pretrain_recipe`; the generated corpus's tokenizer has `vocab_size` tokens at most)."""
    if data == "mock":
        if data_paths is not None or tokenizer is not None:
            raise ValueError("data='mock' generates its sequences: data_paths= and tokenizer= go with data='real'")
        return StrictConfig(MockDataModule, vocab_size=vocab_size, **batch)
    if data != "real":
        raise ValueError(f"data={data!r}: choose 'mock' or 'real'")
    if data_paths is None:
        if tokenizer is not None:
            raise ValueError("tokenizer= goes with data_paths=; the generated corpus brings its own tokenizer")
        corpus = os.path.join(log_dir, "data", "tiny_corpus")
        data_paths = StrictConfig(prepare_tiny_corpus, directory=corpus, vocab_size=vocab_size)
        tokenizer = os.path.join(corpus, "tokenizer")
    if tokenizer is None:
        raise ValueError("data='real' with data_paths needs tokenizer= (a local tokenizer directory or 'byte-level')")
    return StrictConfig(
        PreTrainingDataModule, paths=data_paths, tokenizer=tokenizer, split="969,30,1", num_workers=0, **batch
    )


@run.cli.factory(target=pretrain, name="tiny")
def tiny(
    name: str = "tiny",
    dir: str | None = None,
    num_nodes: int = 1,
    num_gpus_per_node: int = 2,
    data: str | None = None,
    data_paths: list | None = None,
    tokenizer: str | None = None,
    seq_length: int | None = None,
) -> run.Partial:
    """The 130k-parameter model: trains on 2 CPU processes in seconds (`data=real`: on a generated corpus, or on
    your `data_paths` tokenized with `tokenizer`)."""
    return pretrain_recipe(
        name,
        dir,
        num_nodes,
        num_gpus_per_node,
        model_size="tiny",
        data=data,
        data_paths=data_paths,
        tokenizer=tokenizer,
        seq_length=seq_length,
    )


@run.cli.factory(target=pretrain, name="small")
def small(
    name: str = "small",
    dir: str | None = None,
    num_nodes: int = 1,
    num_gpus_per_node: int = 2,
    data: str | None = None,
    pipeline_parallelism: int = 1,
    data_paths: list | None = None,
    tokenizer: str | None = None,
    seq_length: int | None = None,
) -> run.Partial:
    """A 3.7M-parameter model (`data=real`: on a generated corpus, or on your `data_paths` tokenized with
    `tokenizer`). `pipeline_parallelism`: its 4 layers split into that many pipeline stages (1F1B), each step
    running `pipeline_parallelism` micro-batches of 2."""
    data_options = {"data": data, "data_paths": data_paths, "tokenizer": tokenizer, "seq_length": seq_length}
    if pipeline_parallelism == 1:
        return pretrain_recipe(name, dir, num_nodes, num_gpus_per_node, model_size="small", **data_options)
    data_parallel_size = num_nodes * num_gpus_per_node // pipeline_parallelism
    recipe = pretrain_recipe(
        name,
        dir,
        num_nodes,
        num_gpus_per_node,
        model_size="small",
        micro_batch_size=2,
        global_batch_size=2 * data_parallel_size * pipeline_parallelism,
        **data_options,
    )
    recipe.trainer.strategy.pipeline_model_parallel_size = pipeline_parallelism
    return recipe


@run.cli.factory(target=pretrain, name="tiny_moe")
def tiny_moe(
    name: str = "tiny_moe",
    dir: str | None = None,
    num_nodes: int = 1,
    num_gpus_per_node: int = 2,
    expert_model_parallel_size: int = 2,
    data: str = "mock",
) -> run.Partial:
    """The tiny model with 4 experts (top-2, aux and z-loss) in every layer, split over
    `expert_model_parallel_size` ranks (all-to-all token dispatch); runs on 2 or 4 CPU processes."""
    recipe = pretrain_recipe(name, dir, num_nodes, num_gpus_per_node, model_size="tiny_moe", data=data)
    recipe.trainer.strategy.expert_model_parallel_size = expert_model_parallel_size
    return recipe


@run.cli.factory(target=pretrain, name="small_moe")
def small_moe(
    name: str = "small_moe",
    dir: str | None = None,
    num_nodes: int = 1,
    num_gpus_per_node: int = 4,
    expert_model_parallel_size: int = 4,
    data: str = "mock",
) -> run.Partial:
    """The small model with 8 routed experts (top-2) and a shared expert per layer, experts split over
    `expert_model_parallel_size` ranks."""
    recipe = pretrain_recipe(name, dir, num_nodes, num_gpus_per_node, model_size="small_moe", data=data)
    recipe.trainer.strategy.expert_model_parallel_size = expert_model_parallel_size
    return recipe


@run.cli.factory(target=pretrain, name="small_long_context")
def small_long_context(
    name: str = "small_long_context",
    dir: str | None = None,
    num_nodes: int = 1,
    num_gpus_per_node: int = 2,
    seq_length: int = 1024,
    context_parallel_size: int = 2,
    data: str = "mock",
) -> run.Partial:
    """The small model on `seq_length`-token sequences, each split over `context_parallel_size` ranks (ring
    attention, Megatron's load-balanced chunks); one sequence per data-parallel rank and step."""
    data_parallel_size = num_nodes * num_gpus_per_node // context_parallel_size
    recipe = pretrain_recipe(
        name,
        dir,
        num_nodes,
        num_gpus_per_node,
        model_size="small",
        micro_batch_size=1,
        global_batch_size=data_parallel_size,
        data=data,
        seq_length=seq_length,
    )
    recipe.trainer.strategy.context_parallel_size = context_parallel_size
    return recipe


@run.cli.factory(target=pretrain, name="llama3_8b")
def llama3_8b(
    name: str = "llama3_8b",
    dir: str | None = None,
    num_nodes: int = 1,
    num_gpus_per_node: int = 8,
    tensor_parallelism: int = 1,
    pipeline_parallelism: int = 1,
    virtual_pipeline_parallelism: int | None = None,
) -> run.Partial:
    """Llama 3 8B shapes (needs GPUs): FSDP2 with full sharding, built on `meta`, bf16 mixed precision.

    Model parallelism as in NeMo's `llama3_8b` recipe: `tensor_parallelism=1`, `pipeline_parallelism=1`,
    `virtual_pipeline_parallelism=None` (set e.g. 2, 2 and 4 for a pipelined layout; activations between
    stages go in bf16, NeMo's `pipeline_dtype`).
    """
    recipe = pretrain_recipe(
        name,
        dir,
        num_nodes,
        num_gpus_per_node,
        model_size="llama3_8b",
        max_steps=1000,
        micro_batch_size=1,
        global_batch_size=512,
    )
    recipe.trainer.strategy.ddp = ddp("optim_grads_params")
    recipe.trainer.strategy.init_model_with_meta_device = True
    recipe.trainer.strategy.tensor_model_parallel_size = tensor_parallelism
    recipe.trainer.strategy.pipeline_model_parallel_size = pipeline_parallelism
    recipe.trainer.strategy.virtual_pipeline_model_parallel_size = virtual_pipeline_parallelism
    recipe.trainer.strategy.pipeline_dtype = "bf16" if pipeline_parallelism > 1 else None
    recipe.trainer.precision = "bf16-mixed"
    return recipe
