"""megatron-core's own GPTModel (0.19.2, built on CPU with its local layer spec) loads the state our
`export_ckpt(target="megatron")` writes and gives our logits: a Llama model, one with Qwen's options (q/k/v
biases, q/k norms, a head width of its own) and Llama 3.1's rope scaling, and an MoE model (router, experts).
Skips when megatron-core is not importable (`tests/install_megatron_core.sh`)."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from nemo_ckpt import dist_checkpointing
from nemo_ckpt.api import export_ckpt, import_ckpt
from nemo_ckpt.checkpoint.context import load_model, save_context
from nemo_ckpt.checkpoint.layout import weights_dir
from nemo_ckpt.dist_checkpointing import ShardedTensor
from nemo_ckpt.models import GPT, GPTConfig, GPTModel
from tests.helpers.distributed import run_distributed
from tests.helpers.megatron import import_megatron_on_cpu, importorskip_megatron_core, megatron_core_sites, torchrun
from tests.models.megatron_core_gpt_worker import CONFIG, TOKENS, build_model, logits

importorskip_megatron_core("megatron.core.models.gpt")

WORKER = Path(__file__).with_name("megatron_core_gpt_worker.py")

QWEN_LIKE = replace(
    CONFIG,
    kv_channels=32,
    add_qkv_bias=True,
    qk_layernorm=True,
    rope_scaling=True,  # megatron-core's fixed factors: 8, 1, 4, 8192 (GPTConfig's defaults)
)
MOE = replace(CONFIG, num_moe_experts=4, moe_ffn_hidden_size=64, moe_router_topk=2)
# the local spec keeps the norms as modules of their own instead of inside the fused linears
LOCAL_SPEC_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


def megatron_logits(
    rank: int, world_size: int, cases: list[tuple[GPTConfig, dict[str, torch.Tensor]]], tokens: torch.Tensor
) -> list[torch.Tensor]:
    """Logits of megatron-core's GPTModel for each (config, state) of `cases` (one process, tensor/pipeline
    parallel size 1)."""
    import_megatron_on_cpu("megatron.core")
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    models = [build_model(config) for config, _ in cases]
    for model, (_, state) in zip(models, cases):
        model.load_state_dict(state, strict=True)
    return [logits(model, tokens) for model in models]


def per_layer_local_spec(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our exported state (`module.` prefix, layers stacked) as megatron-core's module state (per layer)."""
    state = {}
    for key, tensor in stored.items():
        key = key.removeprefix("module.")
        if not key.startswith("decoder.layers."):
            state[key] = tensor
            continue
        name = key.removeprefix("decoder.layers.")
        for layer, layer_tensor in enumerate(tensor):
            if name.startswith("mlp.experts.experts."):  # experts stacked too: SequentialMLP's local_experts
                module = name.removeprefix("mlp.experts.experts.")
                for expert, expert_tensor in enumerate(layer_tensor):
                    state[f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}.{module}"] = expert_tensor
            else:
                state[f"decoder.layers.{layer}.{LOCAL_SPEC_NAMES.get(name, name)}"] = layer_tensor
    return state


def exported_state(config: GPTConfig, directory: Path) -> tuple[GPT, dict[str, torch.Tensor]]:
    """A random GPT of `config` and its `export_ckpt(target="megatron")` state in megatron-core's module names."""
    torch.manual_seed(0)
    ours = GPT(config)
    with torch.no_grad():
        for param in ours.parameters():
            param.normal_(std=0.05)  # norms and biases too
    checkpoint = directory / "ours"
    weights_dir(checkpoint).mkdir(parents=True)
    state = {
        f"module.{k}": ShardedTensor.from_rank_offsets(f"module.{k}", v, replica_id=0)
        for k, v in ours.state_dict().items()
    }
    dist_checkpointing.save({"state_dict": state}, weights_dir(checkpoint))
    save_context(checkpoint, model=GPTModel(config))
    exported = export_ckpt(str(checkpoint), str(directory / "mcore"), target="megatron")
    return ours, per_layer_local_spec(dist_checkpointing.load_plain_tensors(weights_dir(exported)))


def test_megatron_core_gpt_model_gives_our_logits(tmp_path):
    configs = [CONFIG, QWEN_LIKE, MOE]
    models, states = zip(*(exported_state(config, tmp_path / str(i)) for i, config in enumerate(configs)))
    tokens = torch.randint(CONFIG.vocab_size, (2, 16))
    all_logits = run_distributed(megatron_logits, 1, list(zip(configs, states)), tokens)[0]
    for model, theirs in zip(models, all_logits):
        with torch.no_grad():
            expected = model(tokens)
        torch.testing.assert_close(theirs, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("version", ["0.15.3", "0.19.2"])
def test_megatron_core_loads_our_export_strictly_and_we_import_its_plain_checkpoints(version, tmp_path):
    """Each installed megatron-core version's own `dist_checkpointing.load` (default strictness, which wants every
    `_extra_state` its layers declare) takes our Megatron export; its plain checkpoint (keys without NeMo's
    `module.` prefix) imports here; logits agree both ways."""
    sites = megatron_core_sites()
    if version not in sites:
        pytest.skip(f"megatron-core {version} is not installed: run tests/install_megatron_core.sh")
    model, _ = exported_state(CONFIG, tmp_path)
    torchrun(1, WORKER, str(tmp_path / "mcore"), str(tmp_path / "plain"), site=sites[version])
    with torch.no_grad():
        expected = model(TOKENS)
    torch.testing.assert_close(torch.load(tmp_path / "mcore" / "megatron_logits.pt"), expected, atol=1e-5, rtol=0)
    imported = import_ckpt(f"megatron://{tmp_path / 'plain'}", str(tmp_path / "imported"), config=CONFIG)
    with torch.no_grad():
        ours = load_model(imported)(TOKENS)
    torch.testing.assert_close(ours, torch.load(tmp_path / "plain" / "megatron_logits.pt"), atol=1e-5, rtol=0)
