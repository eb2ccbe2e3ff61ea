"""Hugging Face exports of fine-tunes load: a full and a LoRA fine-tune of an imported Llama (tokenizing with the
tokenizer stored in the import, as the README's flow does), exported without naming the import, carry the
tokenizer they were trained with (`AutoTokenizer` gives its ids) and its bos/eos/pad ids, and give the logits of
the checkpoint."""

import json
import random
from pathlib import Path

import fiddle as fdl
import pytest
import torch

transformers = pytest.importorskip("transformers")

from nemo_ckpt.api import export_ckpt, import_ckpt  # noqa: E402
from nemo_ckpt.checkpoint.context import load_model  # noqa: E402
from nemo_ckpt.checkpoint.layout import LAST_SUFFIX, hf_artifacts_dir  # noqa: E402
from nemo_ckpt.data.tokenizer import train_bpe_tokenizer  # noqa: E402
from recipes.finetune import finetune_recipe  # noqa: E402


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny random Llama whose directory holds its tokenizer (eos `<eod>`, no pad), imported; an SFT set."""
    root = tmp_path_factory.mktemp("finetunes")
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefgh") for _ in range(5)) for _ in range(32)]
    (root / "corpus.txt").write_text("".join(f"echo {word}\n{word}\n" for word in words))
    train_bpe_tokenizer([root / "corpus.txt"], 128, root / "tok")
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(root / "tok" / "tokenizer.json"), eos_token="<eod>", unk_token="<unk>"
    )
    tokenizer.save_pretrained(root / "hf")
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "hf")
    base = import_ckpt(f"hf://{root / 'hf'}", str(root / "base"))
    (root / "sft").mkdir()
    records = [json.dumps({"input": f"echo {word}", "output": word}) for word in words]
    (root / "sft" / "training.jsonl").write_text("\n".join(records) + "\n")
    return base, root / "sft"


@pytest.mark.parametrize("peft_scheme", ["none", "lora"])
def test_export_of_a_finetune_carries_the_tokenizer_it_was_trained_with(tmp_path, imported, peft_scheme):
    base, sft = imported
    recipe = finetune_recipe(
        dir=str(tmp_path),
        num_gpus_per_node=1,
        restore_path=str(base),
        dataset_root=str(sft),
        peft_scheme=peft_scheme,
        max_steps=2,
        micro_batch_size=2,
        seq_length=16,
    )
    recipe.trainer.accelerator = "cpu"
    recipe.trainer.limit_val_batches = 0
    task = fdl.build(recipe)
    task()
    trained_with = task.keywords["data"].tokenizer  # the import's tokenizer (RestoreConfig(load_artifacts=True))
    [checkpoint] = (tmp_path / "finetune" / "checkpoints").glob(f"*{LAST_SUFFIX}")
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in hf_artifacts_dir(checkpoint).iterdir()}
    exported = export_ckpt(str(checkpoint), str(tmp_path / "hf"))

    loaded = transformers.AutoTokenizer.from_pretrained(exported)
    text = "echo abcde\nabcde"
    assert loaded(text)["input_ids"] == trained_with.text_to_ids(text)
    assert loaded.eos_token_id == loaded.pad_token_id == trained_with.eod == 0
    for name in ("config.json", "generation_config.json"):  # not LlamaConfig's defaults (bos 1, eos 2)
        stored = json.loads((exported / name).read_text())
        assert (stored["bos_token_id"], stored["eos_token_id"], stored["pad_token_id"]) == (None, 0, 0), name
    tokens = torch.tensor([trained_with.text_to_ids(text)])
    model = transformers.AutoModelForCausalLM.from_pretrained(exported)
    with torch.no_grad():
        expected = load_model(checkpoint)(tokens)  # an adapter checkpoint: its base, then its adapters
        torch.testing.assert_close(model(tokens).logits, expected, atol=1e-5, rtol=0)
