"""`import_ckpt` / `export_ckpt`: each prints what it wrote (also through `nemo nemo_ckpt import_ckpt`); a model the
converter cannot handle (an MoE model Mixtral cannot express) is refused by name before anything is written; an
adapter checkpoint exports to Megatron-Core naming merged into its base."""

import re
from pathlib import Path

import pytest
import torch

from nemo_ckpt import dist_checkpointing
from nemo_ckpt.checkpoint.context import load_model, save_context
from nemo_ckpt.checkpoint.layout import weights_dir
from nemo_ckpt.conversion import export_ckpt, import_ckpt
from nemo_ckpt.dist_checkpointing import ShardedTensor
from nemo_ckpt.models import GPTConfig, GPTModel, gpt_config
from nemo_ckpt.models.gpt.convert import UnsupportedModelError
from nemo_ckpt.models.gpt.convert.hf import SUPPORTED_ARCHITECTURES
from nemo_ckpt.peft import LoRA, LoRALinear
from tests.helpers import commands


def save_model(checkpoint: Path, model: GPTModel) -> GPTModel:
    """`model`'s checkpoint at `checkpoint` (weights as its `state_dict` saves them, and context)."""
    model.configure_model()
    weights_dir(checkpoint).mkdir(parents=True)
    state = {
        key: ShardedTensor.from_rank_offsets(key, value, replica_id=0) for key, value in model.state_dict().items()
    }
    dist_checkpointing.save({"state_dict": state}, weights_dir(checkpoint))
    save_context(checkpoint, model=model)
    return model


def _files_and_bytes(directory: Path) -> str:
    sizes = [path.stat().st_size for path in directory.rglob("*") if path.is_file()]
    return f"files: {len(sizes)}, {sum(sizes):,} bytes"


def test_import_and_export_print_what_they_wrote(tmp_path, capsys):
    config = gpt_config("tiny", num_query_groups=2)
    torch.manual_seed(0)
    save_model(tmp_path / "ours", GPTModel(config))
    exported = export_ckpt(str(tmp_path / "ours"), str(tmp_path / "mcore"), target="megatron")
    imported = import_ckpt(f"megatron://{exported}", str(tmp_path / "back"), config=config)
    printed = capsys.readouterr().out
    shape = f"2 layers, hidden 64, 4 heads (2 query groups), vocab 256, {config.num_parameters():,} parameters"
    for action, output in (("export_ckpt", exported), ("import_ckpt", imported)):
        assert f"{action}: wrote {output}\n  model: {shape}\n  {_files_and_bytes(output)}" in printed


def test_cli_import_prints_what_it_wrote(tmp_path):
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    transformers.LlamaForCausalLM(hf).save_pretrained(tmp_path / "hf")
    result = commands.nemo(
        "nemo_ckpt", "import_ckpt", f"source=hf://{tmp_path / 'hf'}", f"output_path={tmp_path / 'ours'}", cwd=tmp_path
    )
    assert result.returncode == 0, result.stdout
    assert f"import_ckpt: wrote {tmp_path / 'ours'}\n" in result.stdout
    assert "model: 1 layers, hidden 32, 2 heads (2 query groups), vocab 64, " in result.stdout
    assert _files_and_bytes(tmp_path / "ours") in result.stdout


@pytest.mark.parametrize("command", ["import_ckpt", "export_ckpt"])
def test_help_names_the_supported_families(tmp_path, command):
    result = commands.nemo("nemo_ckpt", command, "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stdout
    text = " ".join(result.stdout.split())  # the help wraps lines
    for architecture in SUPPORTED_ARCHITECTURES:
        assert architecture in text, architecture


def test_qkv_biases_with_qk_norms_export_to_megatron_but_not_to_hugging_face(tmp_path):
    save_model(tmp_path / "both", GPTModel(gpt_config("tiny", add_qkv_bias=True, qk_layernorm=True)))
    refusal = r"add_qkv_bias=True with qk_layernorm=True: no Hugging Face family"
    with pytest.raises(UnsupportedModelError, match=refusal):
        export_ckpt(str(tmp_path / "both"), str(tmp_path / "hf"), target="hf")
    assert not (tmp_path / "hf").exists()
    export_ckpt(str(tmp_path / "both"), str(tmp_path / "mcore"), target="megatron")


def test_moe_models_are_refused_by_name_before_anything_is_written(tmp_path):
    """Hugging Face takes MoE models Mixtral can express (tests/models/test_hf_families.py), Megatron-Core naming
    all-MoE models (tests/models/test_megatron_naming.py); others are refused, naming the option."""
    mixed = gpt_config("tiny_moe", moe_shared_expert_intermediate_size=64, moe_layer_freq=2)  # layer 1 dense
    save_model(tmp_path / "moe", GPTModel(mixed))
    refusals = {
        "hf": "cannot export to Hugging Face: moe_layer_freq=2 (Mixtral, the Hugging Face MoE family, has "
        "moe_layer_freq=1); moe_shared_expert_intermediate_size=64 (Mixtral, the Hugging Face MoE family, has "
        "moe_shared_expert_intermediate_size=None)",
        "megatron": "cannot export to Megatron-Core naming: moe_layer_freq=2: dense and MoE layers mixed do not "
        "export to Megatron-Core naming yet",
    }
    for target, message in refusals.items():
        with pytest.raises(UnsupportedModelError, match=re.escape(message)):
            export_ckpt(str(tmp_path / "moe"), str(tmp_path / target), target=target)
    save_model(tmp_path / "dense", GPTModel(gpt_config("tiny")))
    exported = export_ckpt(str(tmp_path / "dense"), str(tmp_path / "mcore"), target="megatron")
    with pytest.raises(UnsupportedModelError, match="dense and MoE layers mixed do not import from Megatron-Core"):
        import_ckpt(f"megatron://{exported}", str(tmp_path / "back"), config=mixed)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["dense", "mcore", "moe"]


def test_adapter_checkpoint_exports_to_megatron_merged_into_its_base(tmp_path):
    config = GPTConfig()
    torch.manual_seed(0)
    base = save_model(tmp_path / "base", GPTModel(config))
    trained = GPTModel(config, peft=LoRA(base_checkpoint=str(tmp_path / "base")))
    trained.configure_model()
    trained.load_state_dict(base.state_dict(), strict=False)
    with torch.no_grad():
        for module in trained.modules():
            if isinstance(module, LoRALinear):
                module.lora_b.normal_(std=0.02)
    save_model(tmp_path / "adapters", trained)
    exported = export_ckpt(str(tmp_path / "adapters"), str(tmp_path / "mcore"), target="megatron")
    back = import_ckpt(f"megatron://{exported}", str(tmp_path / "back"), config=config)
    tokens = torch.randint(256, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(load_model(back)(tokens), trained(tokens), atol=1e-6, rtol=0)
