"""LoRA: adapters only train, merged weights reproduce base + adapters, small adapter checkpoints, FSDP2, TP;
`load_model` of an adapter checkpoint loads its base and its adapters."""

from pathlib import Path

import pytest
import torch

from nemo_ckpt import dist_checkpointing
from nemo_ckpt.checkpoint.context import load_model, save_context
from nemo_ckpt.checkpoint.layout import weights_dir
from nemo_ckpt.data.mock import ArithmeticSequences
from nemo_ckpt.dist_checkpointing import ShardedTensor
from nemo_ckpt.models import GPT, GPTModel, gpt_config
from nemo_ckpt.peft import LoRA, LoRALinear
from nemo_ckpt.peft.merge import merge
from tests.helpers.distributed import run_distributed
from tests.peft.lora_training import train_lora, train_lora_tensor_parallel


def lora_gpt(config=None, **lora) -> GPT:
    torch.manual_seed(0)
    model = GPT(config or gpt_config("tiny"))
    LoRA(**lora).apply(model)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoRALinear):
                module.lora_b.normal_(std=0.02)  # trained adapters: a zero B would make the test trivial
    return model


def test_only_adapters_train_and_megatron_names_select_layers():
    model = lora_gpt(target_modules=["linear_qkv", "down_proj"])
    trainable = sorted(name for name, param in model.named_parameters() if param.requires_grad)
    assert trainable == sorted(
        f"layers.{i}.{layer}.{param}"
        for i in range(2)
        for layer in ("self_attention.q_proj", "self_attention.k_proj", "self_attention.v_proj", "mlp.down_proj")
        for param in ("lora_a", "lora_b")
    )
    assert "layers.0.self_attention.q_proj.weight" in model.state_dict()  # base names unchanged


def merged_copy(model: GPT) -> GPT:
    """A plain GPT holding `model`'s weights with its adapters merged in."""
    merged = GPT(model.config)
    state = {}
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            state[f"{name}.weight"] = module.merged_weight()
    for key, value in model.state_dict().items():
        if not LoRA.is_adapter_key(key):
            state.setdefault(key, value)
    merged.load_state_dict(state)
    return merged


@pytest.mark.parametrize("config", [{}, {"add_qkv_bias": True}])
def test_merged_weights_give_the_logits_of_base_plus_adapters(config):
    model = lora_gpt(gpt_config("tiny", **config))
    if config:  # Qwen2's biased q/k/v: the adapters leave the bias frozen and in place
        with torch.no_grad():
            model.layers[0].self_attention.q_proj.bias.normal_()
        assert not model.layers[0].self_attention.q_proj.bias.requires_grad
    tokens = torch.randint(256, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(merged_copy(model)(tokens), model(tokens), atol=1e-6, rtol=0)


def test_adapter_checkpoint_of_the_small_model_is_under_5_percent():
    model = GPTModel(gpt_config("small"), peft=LoRA())
    with torch.device("meta"):
        model.configure_model()
    adapter_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    full_bytes = sum(t.numel() * t.element_size() for t in model.module.state_dict().values())
    assert set(model.state_dict()) == {
        k for k in map("module.{}".format, model.module.state_dict()) if k.endswith(("lora_a", "lora_b"))
    }
    assert adapter_bytes < 0.05 * full_bytes


def _save_base(path: Path) -> GPTModel:
    torch.manual_seed(7)
    base = GPTModel(gpt_config("tiny"))
    base.configure_model()
    weights_dir(path).mkdir()
    state = {key: ShardedTensor.from_rank_offsets(key, value, replica_id=0) for key, value in base.state_dict().items()}
    dist_checkpointing.save({"state_dict": state}, weights_dir(path))
    return base


def test_lora_under_fsdp2_on_two_ranks_matches_one_process(tmp_path):
    base = _save_base(tmp_path)
    steps = 5
    single = train_lora(0, 1, "no_shard", steps, str(tmp_path))  # in this process: one device needs no spawning
    sharded = run_distributed(train_lora, 2, "optim_grads_params", steps, str(tmp_path))
    dataset = ArithmeticSequences(steps * 4, 32, 256, seed=1234)
    batch = {key: torch.stack([dataset[i][key] for i in range(4)]) for key in dataset[0]}
    with torch.no_grad():
        assert single[0] == pytest.approx(float(base.loss(batch)), abs=1e-5)  # the base weights were restored
    assert len(single) == steps
    for losses in sharded:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(single), atol=1e-5, rtol=0)
    assert single[-1] < single[0]


def test_lora_under_tensor_parallel_two_matches_one_process(tmp_path):
    _save_base(tmp_path)
    steps = 4
    single = train_lora(0, 1, "no_shard", steps, str(tmp_path))
    per_rank = run_distributed(train_lora_tensor_parallel, 2, steps, str(tmp_path))
    for losses, placements in per_rank:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(single), atol=1e-5, rtol=0)
        # Megatron-Core's sharding: column-parallel base -> A replicated, B split on its rows (the base's outputs);
        # row-parallel base -> A split on its columns (the base's inputs), B replicated
        assert placements["layers.0.self_attention.q_proj.lora_a"] == ("Replicate()", (4, 64))
        assert placements["layers.0.self_attention.q_proj.lora_b"] == ("Shard(dim=0)", (32, 4))
        assert placements["layers.0.mlp.down_proj.lora_a"] == ("Shard(dim=1)", (4, 86))
        assert placements["layers.0.mlp.down_proj.lora_b"] == ("Replicate()", (64, 4))
    assert single[-1] < single[0]


def test_bad_lora_options():
    with pytest.raises(ValueError, match=r"LoRA\(dim=0\)"):
        LoRA(dim=0)


def test_load_model_of_an_adapter_checkpoint_loads_its_base_then_the_adapters(tmp_path):
    (tmp_path / "base").mkdir()
    base = _save_base(tmp_path / "base")
    trained = GPTModel(base.config, peft=LoRA(base_checkpoint=str(tmp_path / "base")))
    trained.configure_model()
    trained.load_state_dict(base.state_dict(), strict=False)
    with torch.no_grad():
        for module in trained.modules():
            if isinstance(module, LoRALinear):
                module.lora_b.normal_(std=0.02)
    adapters = tmp_path / "adapters"
    weights_dir(adapters).mkdir(parents=True)
    state = {
        key: ShardedTensor.from_rank_offsets(key, value, replica_id=0) for key, value in trained.state_dict().items()
    }
    dist_checkpointing.save({"state_dict": state}, weights_dir(adapters))
    save_context(adapters, model=trained)
    tokens = torch.randint(256, (2, 12))
    with torch.no_grad():
        expected = trained(tokens)
        torch.testing.assert_close(load_model(adapters)(tokens), expected, atol=0, rtol=0)
        torch.testing.assert_close(
            load_model(merge(adapters, tmp_path / "merged"))(tokens), expected, atol=1e-6, rtol=0
        )
    (tmp_path / "base").rename(tmp_path / "moved")
    with pytest.raises(FileNotFoundError, match=r"holds only LoRA adapters, for the base checkpoint .*base, which is"):
        load_model(adapters)
