"""A LoRA adapter checkpoint generates with its adapters applied, unmerged, the greedy tokens of its merged
Hugging Face export under transformers' `generate`."""

from pathlib import Path

import pytest
import torch

from nemo_ckpt import dist_checkpointing
from nemo_ckpt.checkpoint.context import load_model, save_context
from nemo_ckpt.checkpoint.layout import weights_dir
from nemo_ckpt.dist_checkpointing import ShardedTensor
from nemo_ckpt.inference.generate import generate_tokens
from nemo_ckpt.inference.sampling import SamplingParams
from nemo_ckpt.models import GPTModel, gpt_config
from nemo_ckpt.models.gpt.convert import export_hf
from nemo_ckpt.peft import LoRA, LoRALinear
from nemo_ckpt.peft.merge import merge


def save_weights(model: GPTModel, path) -> None:
    weights_dir(path).mkdir(parents=True)
    state = {
        key: ShardedTensor.from_rank_offsets(key, tensor, replica_id=0) for key, tensor in model.state_dict().items()
    }
    dist_checkpointing.save({"state_dict": state}, weights_dir(path))
    save_context(path, model=model)


def make_lora_checkpoints(root: Path) -> tuple[Path, Path]:
    """A tiny base checkpoint and a LoRA adapter checkpoint on it (random adapters)."""
    torch.manual_seed(7)
    base = GPTModel(gpt_config("tiny", num_query_groups=2))
    base.configure_model()
    save_weights(base, root / "base")
    trained = GPTModel(base.config, peft=LoRA(base_checkpoint=str(root / "base")))
    trained.configure_model()
    trained.load_state_dict(base.state_dict(), strict=False)
    with torch.no_grad():
        for module in trained.modules():
            if isinstance(module, LoRALinear):
                module.lora_b.normal_(std=0.05)
    save_weights(trained, root / "adapters")
    return root / "base", root / "adapters"


def test_adapter_checkpoint_generates_its_merged_export(tmp_path):
    transformers = pytest.importorskip("transformers")
    make_lora_checkpoints(tmp_path)
    unmerged = load_model(tmp_path / "adapters")
    assert any(isinstance(module, LoRALinear) for module in unmerged.modules())
    prompts = [[3, 4, 5, 6], [7, 8]]
    ours = generate_tokens(unmerged, prompts, SamplingParams(max_new_tokens=16))
    assert ours != generate_tokens(load_model(tmp_path / "base"), prompts, SamplingParams(max_new_tokens=16))

    exported = export_hf(merge(tmp_path / "adapters", tmp_path / "merged"), tmp_path / "hf")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(exported)
    for prompt, tokens in zip(prompts, ours):
        expected = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        assert tokens == expected[0, len(prompt) :].tolist()
