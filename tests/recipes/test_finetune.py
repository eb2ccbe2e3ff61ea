"""`finetune` from an imported Hugging Face model: restored weights with a fresh optimizer at step 0, the loss
falls on an SFT set, LoRA adapter checkpoints resume bit-identically, merge and export."""

import json
from pathlib import Path

import fiddle as fdl
import nemo_run as run
import pytest
import torch

transformers = pytest.importorskip("transformers")

from nemo_ckpt import dist_checkpointing  # noqa: E402
from nemo_ckpt.api import export_ckpt  # noqa: E402
from nemo_ckpt.checkpoint.context import load_model  # noqa: E402
from nemo_ckpt.checkpoint.layout import weights_dir  # noqa: E402
from nemo_ckpt.checkpoint.manifest import Manifest  # noqa: E402
from nemo_ckpt.checkpoint.resume import AutoResume, RestoreConfig, load_restore_weights  # noqa: E402
from nemo_ckpt.data.sft import SFTDataset, read_jsonl  # noqa: E402
from nemo_ckpt.data.tokenizer import ByteLevelTokenizer  # noqa: E402
from nemo_ckpt.models import GPTConfig, GPTModel  # noqa: E402
from nemo_ckpt.peft import LoRA  # noqa: E402
from nemo_ckpt.peft.merge import merge  # noqa: E402
from recipes.finetune import finetune_recipe  # noqa: E402
from tests.checkpoint.finetune_run import imported_model_and_sft_set  # noqa: E402
from tests.helpers.trainer import RecordLoss, StopAndSave  # noqa: E402

SEQ_LENGTH = 16


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny random HF Llama imported as our checkpoint, and an SFT set of echo tasks."""
    return imported_model_and_sft_set(tmp_path_factory.mktemp("finetune"))


def run_finetune(
    directory: Path,
    imported,
    peft_scheme: str,
    max_steps: int,
    stop_at: int | None = None,
    lr: float = 1e-2,
    packed_sequence: bool = False,
) -> list[float]:
    base, data = imported
    recipe = finetune_recipe(
        dir=str(directory),
        num_gpus_per_node=1,
        restore_path=str(base),
        dataset_root=str(data),
        tokenizer="byte-level",
        peft_scheme=peft_scheme,
        max_steps=max_steps,
        micro_batch_size=4,
        seq_length=SEQ_LENGTH,
        packed_sequence=packed_sequence,
    )
    recipe.trainer.accelerator = "cpu"
    recipe.trainer.callbacks = [run.Config(RecordLoss), run.Config(StopAndSave, stop_at=stop_at, path=None)]
    recipe.trainer.limit_val_batches = 0
    recipe.log.ckpt.every_n_train_steps = 2
    recipe.log.ckpt.save_top_k = -1
    recipe.optim.lr = lr
    recipe.optim.lr_warmup_steps = 0
    task = fdl.build(recipe)
    task()
    [recorder] = [c for c in task.keywords["trainer"].callbacks if isinstance(c, RecordLoss)]
    return recorder.losses


def checkpoints(directory: Path) -> dict[int, Path]:
    """The run's checkpoints by step."""
    checkpoint_dir = directory / "finetune" / "checkpoints"
    return {
        int(r.name.rsplit("step=", 1)[1]): checkpoint_dir / r.name for r in Manifest.read(checkpoint_dir).checkpoints
    }


def first_batch_loss(base: Path, data: Path) -> float:
    """The base model's answer-only loss on the run's first micro-batch (samples 0-3 of the seed-1234 order)."""
    records = read_jsonl(data / "training.jsonl")
    dataset = SFTDataset(records, ByteLevelTokenizer(), SEQ_LENGTH, 64, "{input}\n", "{role}: {content}\n", 1234)
    batch = {key: torch.stack([dataset[i][key] for i in range(4)]) for key in dataset[0]}
    with torch.no_grad():
        return float(load_model(base).loss(batch))


def test_full_finetune_starts_from_the_import_and_learns(tmp_path, imported):
    losses = run_finetune(tmp_path, imported, "none", max_steps=6)
    assert losses[0] == pytest.approx(first_batch_loss(*imported), abs=1e-5)  # restored weights, nothing trained
    assert sum(losses[-2:]) / 2 < losses[0] - 1.0
    assert sorted(checkpoints(tmp_path)) == [2, 4, 6]  # the run counts its own steps from 0
    exported = export_ckpt(str(checkpoints(tmp_path)[6]), str(tmp_path / "hf"), artifacts_from=str(imported[0]))
    assert json.loads((exported / "config.json").read_text())["num_key_value_heads"] == 2  # the import's config
    tokens = torch.randint(260, (1, 8))
    with torch.no_grad():
        expected = load_model(checkpoints(tmp_path)[6])(tokens)
        actual = transformers.AutoModelForCausalLM.from_pretrained(exported)(tokens).logits
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)


def test_packed_sequence_finetune_learns(tmp_path, imported):
    recipe = finetune_recipe(restore_path=str(imported[0]), dataset_root=str(imported[1]), packed_sequence=True)
    assert fdl.build(recipe.data).packed_sequence_specs.packed_sequence_size == -1  # rows of seq_length tokens
    losses = run_finetune(tmp_path, imported, "none", max_steps=6, packed_sequence=True)
    assert sum(losses[-2:]) / 2 < losses[0] - 1.0


def test_lora_resumes_bit_identically_and_merges_and_exports(tmp_path, imported):
    base, _ = imported
    uninterrupted = run_finetune(tmp_path / "a", imported, "lora", max_steps=4)
    run_finetune(tmp_path / "b", imported, "lora", max_steps=4, stop_at=2)
    resumed = run_finetune(tmp_path / "b", imported, "lora", max_steps=4)
    assert resumed == uninterrupted[2:]
    adapter_ckpt = checkpoints(tmp_path / "a")[4]
    stored = dist_checkpointing.load_plain_tensors(weights_dir(adapter_ckpt))
    assert stored.keys() == dist_checkpointing.load_plain_tensors(weights_dir(checkpoints(tmp_path / "b")[4])).keys()
    for key, value in dist_checkpointing.load_plain_tensors(weights_dir(checkpoints(tmp_path / "b")[4])).items():
        assert torch.equal(value, stored[key]), key
    model_keys = [key for key in stored if not key.startswith("optimizer.")]
    assert model_keys and all(key.endswith((".lora_a", ".lora_b")) for key in model_keys)

    lora_model = GPTModel(load_model(base, load_weights=False).config, peft=LoRA())
    lora_model.configure_model()
    load_restore_weights(lora_model, base, LoRA.is_adapter_key)
    lora_model.load_state_dict({key: stored[key] for key in model_keys}, strict=False)
    merged = merge(adapter_ckpt, tmp_path / "merged")
    tokens = torch.randint(260, (2, 12))
    with torch.no_grad():
        expected = lora_model(tokens)
        torch.testing.assert_close(load_model(merged)(tokens), expected, atol=1e-6, rtol=0)
    exported = export_ckpt(str(adapter_ckpt), str(tmp_path / "hf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported)
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, expected, atol=1e-5, rtol=0)


def test_restore_errors_before_training(tmp_path, imported):
    with pytest.raises(FileNotFoundError, match="RestoreConfig.*is not a complete checkpoint"):
        RestoreConfig(path=str(tmp_path / "nowhere")).check()
    with pytest.raises(ValueError, match=r"load_optim_state=True\) is not supported"):
        RestoreConfig(path="x", load_optim_state=True)
    base, _ = imported
    wrong = GPTModel(GPTConfig(num_layers=3, vocab_size=260))
    wrong.configure_model()
    with pytest.raises(ValueError, match=r"another architecture.*module.layers.2"):
        load_restore_weights(wrong, base)
    with pytest.raises(ValueError, match=r"LoRA\(target_modules=\['qkv'\]\): \['qkv'\] match no linear layer"):
        GPTModel(wrong.config, peft=LoRA(target_modules=["qkv"])).configure_model()
    assert isinstance(AutoResume(restore_config=RestoreConfig(path=str(base))).restore_config, RestoreConfig)
