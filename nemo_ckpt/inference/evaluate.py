"""`evaluate`: the loss and perplexity of a checkpoint on an indexed dataset or a JSONL file of SFT records, the
numbers the training loop's validation computes on the same data.

The data (`data=`):

- an indexed dataset prefix (Megatron's `PREFIX.bin` + `PREFIX.idx`, `python -m nemo_ckpt.data.preprocess`): one
  epoch of its GPT samples of `seq_length` tokens (default: the model's), as `PreTrainingDataModule(paths={"validation":
  PREFIX}, seed=seed)` validates on it (every document, in Megatron's shuffled order, without the last partial
  sample); every token is scored;
- a `.jsonl` file of SFT records (`{"input": ..., "output": ...}` or `{"messages": [...]}`, `nemo_ckpt.data.sft`):
  one epoch of them as `FineTuningDataModule(seed=seed)` validates on its `validation.jsonl`, each cut or padded
  to `seq_length` tokens (default: the model's, at most 2048, as the fine-tuning recipes set it); only the answer
  tokens (and the closing end-of-document) are scored, the `loss_mask` of fine-tuning.

Both are tokenized with the checkpoint's tokenizer (`context/hf`, the one it was trained with) unless `tokenizer=`
names another. The averages:

- `loss`: the mean negative log-likelihood of every scored token (token-weighted), `perplexity = exp(loss)`;
- `val_loss`: what the training loop's validation logs as `val_loss` on these samples in micro-batches of
  `micro_batch_size`: each micro-batch's token mean (`GPTModel.loss`), averaged over the micro-batches weighted by
  their samples (Lightning's epoch mean of `self.log(..., batch_size=...)`), over the whole micro-batches only (as
  Megatron's sampler, validation leaves a last partial micro-batch out; `loss` scores it). On an indexed dataset
  every sample has `seq_length` scored tokens, so the two agree; on SFT records, whose answers differ in length,
  they differ.
"""

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from nemo_ckpt.checkpoint.context import load_model
from nemo_ckpt.checkpoint.hf_tokenizer import has_tokenizer
from nemo_ckpt.checkpoint.layout import hf_artifacts_dir
from nemo_ckpt.data.blended_dataset import build_split_dataset
from nemo_ckpt.data.gpt_dataset import GPTDatasetConfig, Split
from nemo_ckpt.data.indexed_dataset import get_bin_path, get_idx_path
from nemo_ckpt.data.pretraining import BATCH_KEYS
from nemo_ckpt.data.sft import SFTDataset, read_jsonl
from nemo_ckpt.data.tokenizer import Tokenizer, get_tokenizer
from nemo_ckpt.models.gpt.lightning import GPTModel
from nemo_ckpt.models.gpt.model import VocabularyError

WHOLE_DATASET = "0,1,0"  # every document to the validation split
SFT_MAX_SEQ_LENGTH = 2048  # recipes.finetune's data seq_length: min(model.seq_length, 2048)


@dataclass(frozen=True)
class EvalResult:
    """A checkpoint's loss on some data (see the module docstring for how each is averaged)."""

    checkpoint: str
    data: str
    loss: float
    perplexity: float
    tokens: int
    samples: int
    val_loss: float | None

    def summary(self) -> str:
        val_loss = "n/a (fewer samples than one micro-batch)" if self.val_loss is None else f"{self.val_loss:.6f}"
        return (
            f"{self.checkpoint} on {self.data}\n"
            f"  loss {self.loss:.6f}, perplexity {self.perplexity:.4f} ({self.tokens:,} tokens, "
            f"{self.samples:,} samples)\n"
            f"  val_loss {val_loss} (the training loop's validation on these samples)"
        )


def checkpoint_tokenizer(checkpoint: str | Path, tokenizer: str | None = None) -> Tokenizer:
    """`tokenizer` (a `get_tokenizer` name or path), else the one `checkpoint` stores in `context/hf`."""
    if tokenizer is not None:
        return get_tokenizer(tokenizer)
    directory = hf_artifacts_dir(checkpoint)
    if not has_tokenizer(directory):
        raise FileNotFoundError(
            f"{checkpoint} stores no tokenizer ({directory} holds no tokenizer.json or tokenizer.model): pass "
            "tokenizer=<the one its data was tokenized with> (a directory, a .model file or byte-level)"
        )
    return get_tokenizer(directory)


def eval_dataset(
    data: str,
    tokenizer: Tokenizer,
    seq_length: int,
    seed: int,
    prompt_template: str,
    message_template: str,
    index_mapping_dir: str | None,
) -> Dataset:
    """The samples of `data` (an indexed dataset prefix or a `.jsonl` file), in the order validation reads them."""
    if data.endswith(".jsonl"):
        if not Path(data).is_file():
            raise FileNotFoundError(f"evaluate(data={data!r}): no such JSONL file")
        records = read_jsonl(Path(data))
        # FineTuningDataModule shuffles its validation records with seed + 1
        return SFTDataset(records, tokenizer, seq_length, None, prompt_template, message_template, seed + 1)
    missing = [path for path in (get_bin_path(data), get_idx_path(data)) if not Path(path).is_file()]
    if missing:
        raise FileNotFoundError(
            f"evaluate(data={data!r}): {' and '.join(missing)} missing; pass an indexed dataset prefix (PREFIX for "
            "PREFIX.bin + PREFIX.idx) or a .jsonl file of SFT records"
        )
    config = GPTDatasetConfig(seq_length, tokenizer.eod, random_seed=seed, path_to_cache=index_mapping_dir)
    return build_split_dataset([data], None, WHOLE_DATASET, Split.valid, None, config)


def check_token_ids(batch: dict[str, torch.Tensor], vocab_size: int, data: str) -> None:
    """Refuse token ids the model has no embedding row for (data tokenized with a larger tokenizer)."""
    largest = int(torch.maximum(batch["tokens"].max(), batch["labels"].max()))
    if largest >= vocab_size:
        raise VocabularyError(
            f"{data} holds token id {largest}, but the model's vocabulary has {vocab_size} ids: the data was "
            "tokenized with another tokenizer; re-run preprocessing with the checkpoint's (context/hf)"
        )


@torch.no_grad()
def evaluate(
    path: str,
    data: str,
    micro_batch_size: int = 4,
    seq_length: int | None = None,
    tokenizer: str | None = None,
    seed: int = 1234,
    prompt_template: str = "{input}\n",
    message_template: str = "{role}: {content}\n",
    index_mapping_dir: str | None = None,
    device: str | None = None,
    trust_code: bool = False,
) -> EvalResult:
    """The loss and perplexity of checkpoint `path` on `data` (an indexed dataset prefix or a `.jsonl` file of SFT
    records; see the module docstring), printed and returned. Runs in one process on `device` (default: CUDA when
    available), in float32. `seq_length`, `seed`, `prompt_template`, `message_template`: the data module's, for the
    same samples in the same order as its validation; `index_mapping_dir`: where an indexed dataset's index files
    are cached (default: beside the data, as `PreTrainingDataModule`). An adapter checkpoint (LoRA) evaluates
    base + adapters.
    """
    if micro_batch_size < 1:
        raise ValueError(f"evaluate(micro_batch_size={micro_batch_size}): use 1 or more")
    model = load_model(path, trust_code=trust_code)
    if not isinstance(model, GPTModel):
        raise ValueError(f"{path} holds a {type(model).__name__}; evaluate takes GPTModel checkpoints")
    if seq_length is None:
        is_sft = data.endswith(".jsonl")
        seq_length = min(model.config.seq_length, SFT_MAX_SEQ_LENGTH) if is_sft else model.config.seq_length
    text_tokenizer = checkpoint_tokenizer(path, tokenizer)
    dataset = eval_dataset(data, text_tokenizer, seq_length, seed, prompt_template, message_template, index_mapping_dir)
    model = model.float().eval().to(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    loader = DataLoader(dataset, batch_size=micro_batch_size, collate_fn=stack_batch)
    loss_sum, tokens, samples = 0.0, 0, 0
    val_loss_sum, val_samples = 0.0, 0
    for batch in loader:
        check_token_ids(batch, model.config.vocab_size, data)
        batch = {key: value.to(model.device) for key, value in batch.items()}
        mean = float(model.loss(batch))  # the token mean over the loss mask, as validation_step computes it
        count = int(batch["loss_mask"].sum())
        size = batch["tokens"].shape[0]
        loss_sum, tokens, samples = loss_sum + mean * count, tokens + count, samples + size
        if size == micro_batch_size:
            val_loss_sum, val_samples = val_loss_sum + mean * size, val_samples + size
    if tokens == 0:
        raise ValueError(f"{data}: no token to score (every loss_mask is 0)")
    loss = loss_sum / tokens
    result = EvalResult(
        checkpoint=str(path),
        data=str(data),
        loss=loss,
        perplexity=math.exp(loss),
        tokens=tokens,
        samples=samples,
        val_loss=val_loss_sum / val_samples if val_samples else None,
    )
    print(f"evaluate: {result.summary()}", flush=True)
    return result


def stack_batch(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The keys `GPTModel.loss` reads from the data modules' batches (tokens, labels, loss_mask), stacked."""
    return {key: torch.stack([sample[key] for sample in samples]) for key in BATCH_KEYS}
