"""GPT fine-tuning recipes: a `run.Partial` of `nemo_ckpt.api.finetune` (NeMo's `llm.finetune`), full or LoRA.

recipe = finetune_recipe(name="sft", restore_path="ckpts/imported", dataset_root="data/sft", peft_scheme="lora")
recipe.trainer.max_steps = 20

The model's config is the restored checkpoint's (an imported Hugging Face model or another run's checkpoint);
the tokenizer defaults to the one stored with it (`RestoreConfig(load_artifacts=True)`: an imported model's
`<restore_path>/context/hf`).
"""

import nemo_run as run

from nemo_ckpt.api import finetune
from nemo_ckpt.checkpoint import AutoResume, ModelCheckpoint
from nemo_ckpt.checkpoint.resume import RestoreConfig
from nemo_ckpt.data.sft import FineTuningDataModule, PackedSequenceSpecs
from nemo_ckpt.logger import NeMoLogger
from nemo_ckpt.models import GPTModel, gpt_config
from nemo_ckpt.models.gpt.convert.checkpoint_io import checkpoint_gpt_config
from nemo_ckpt.optim import OptimizerConfig
from nemo_ckpt.peft import LoRA
from recipes.gpt import trainer
from recipes.strict_config import StrictConfig

PEFT_SCHEMES = ("lora", "none")


def finetune_recipe(
    name: str = "finetune",
    dir: str | None = None,
    num_nodes: int = 1,
    num_gpus_per_node: int = 2,
    restore_path: str | None = None,
    dataset_root: str | None = None,
    tokenizer: str | None = None,
    peft_scheme: str = "lora",
    model_size: str = "tiny",
    max_steps: int = 20,
    micro_batch_size: int = 4,
    global_batch_size: int | None = None,
    seq_length: int | None = None,
    packed_sequence: bool = False,
) -> run.Partial:
    """Fine-tune the checkpoint `restore_path` on the JSONL records in `dataset_root` (`training.jsonl`, optional
    `validation.jsonl`), with LoRA adapters (`peft_scheme="lora"`) or all weights (`"none"`). `packed_sequence`:
    several samples per row of `seq_length` tokens (`PackedSequenceSpecs`), as NeMo's recipes name it.

    The model config comes from `restore_path` when it stores one, else from the `model_size` preset.
    """
    if restore_path is None or dataset_root is None:
        raise ValueError(
            "finetune_recipe needs restore_path= (a checkpoint or an imported Hugging Face model, see import_ckpt) "
            "and dataset_root= (a directory with training.jsonl)"
        )
    if peft_scheme not in PEFT_SCHEMES:
        raise ValueError(f"finetune_recipe(peft_scheme={peft_scheme!r}): choose one of {PEFT_SCHEMES}")
    try:
        model = checkpoint_gpt_config(restore_path)
    except FileNotFoundError:
        model = gpt_config(model_size)
    data_parallel_size = num_nodes * num_gpus_per_node
    recipe = run.Partial(
        finetune,
        model=StrictConfig(GPTModel, config=StrictConfig(type(model), **vars(model))),
        data=StrictConfig(
            FineTuningDataModule,
            dataset_root=dataset_root,
            tokenizer=tokenizer,
            seq_length=seq_length or min(model.seq_length, 2048),
            micro_batch_size=micro_batch_size,
            global_batch_size=global_batch_size or micro_batch_size * data_parallel_size,
            packed_sequence_specs=StrictConfig(PackedSequenceSpecs) if packed_sequence else None,
        ),
        trainer=trainer(num_nodes, num_gpus_per_node, max_steps),
        log=StrictConfig(
            NeMoLogger,
            name=name,
            log_dir=dir or "nemo_experiments",
            ckpt=StrictConfig(ModelCheckpoint, save_top_k=1, save_last=True, every_n_train_steps=10),
        ),
        resume=StrictConfig(
            AutoResume,
            restore_config=StrictConfig(RestoreConfig, path=restore_path),
            resume_if_exists=True,
            resume_ignore_no_checkpoint=True,
        ),
        optim=StrictConfig(OptimizerConfig, lr=1e-4 if peft_scheme == "none" else 1e-3, min_lr=1e-5, lr_warmup_steps=2),
    )
    if peft_scheme == "lora":
        recipe.peft = StrictConfig(LoRA)
    return recipe


@run.cli.factory(target=finetune, name="tiny")
def tiny(
    restore_path: str | None = None,
    dataset_root: str | None = None,
    name: str = "finetune_tiny",
    dir: str | None = None,
    num_gpus_per_node: int = 2,
    peft_scheme: str = "lora",
) -> run.Partial:
    """Fine-tune a tiny model (e.g. a small imported Hugging Face Llama) on 2 CPU processes in seconds."""
    return finetune_recipe(name, dir, 1, num_gpus_per_node, restore_path, dataset_root, peft_scheme=peft_scheme)


@run.cli.factory(target=finetune, name="small")
def small(
    restore_path: str | None = None,
    dataset_root: str | None = None,
    name: str = "finetune_small",
    dir: str | None = None,
    num_gpus_per_node: int = 2,
    peft_scheme: str = "lora",
) -> run.Partial:
    """Fine-tune the `small` model shape."""
    return finetune_recipe(
        name, dir, 1, num_gpus_per_node, restore_path, dataset_root, peft_scheme=peft_scheme, model_size="small"
    )


@run.cli.factory(target=finetune, name="llama3_8b")
def llama3_8b(
    restore_path: str | None = None,
    dataset_root: str | None = None,
    name: str = "finetune_llama3_8b",
    dir: str | None = None,
    num_nodes: int = 1,
    num_gpus_per_node: int = 8,
    peft_scheme: str = "lora",
) -> run.Partial:
    """Llama 3 8B (needs GPUs): FSDP2, bf16 mixed precision, sequences of 4096."""
    recipe = finetune_recipe(
        name,
        dir,
        num_nodes,
        num_gpus_per_node,
        restore_path,
        dataset_root,
        peft_scheme=peft_scheme,
        model_size="llama3_8b",
        max_steps=1000,
        micro_batch_size=1,
        global_batch_size=128,
        seq_length=4096,
    )
    recipe.trainer.strategy.ddp.data_parallel_sharding_strategy = "optim_grads_params"
    recipe.trainer.strategy.ddp.overlap_param_gather = True
    recipe.trainer.precision = "bf16-mixed"
    return recipe
