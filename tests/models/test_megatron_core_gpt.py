"""megatron-core's own GPTModel (0.19.2, built on CPU with its local layer spec) loads the state our
`export_ckpt(target="megatron")` writes and gives our logits. Skips when megatron-core is not importable
(`tests/install_megatron_core.sh`)."""

import contextlib

import torch
import torch.nn.functional as F

from nemo_ckpt import dist_checkpointing
from nemo_ckpt.api import export_ckpt
from nemo_ckpt.checkpoint.context import save_context
from nemo_ckpt.checkpoint.layout import weights_dir
from nemo_ckpt.dist_checkpointing import ShardedTensor
from nemo_ckpt.models import GPT, GPTModel, gpt_config
from tests.helpers.distributed import run_distributed
from tests.helpers.megatron import import_megatron_on_cpu, importorskip_megatron_core

importorskip_megatron_core("megatron.core.models.gpt")

CONFIG = gpt_config("tiny", num_attention_heads=4, num_query_groups=2, num_layers=2)
# the local spec keeps the norms as modules of their own instead of inside the fused linears
LOCAL_SPEC_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


def megatron_logits(rank: int, world_size: int, state: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """Logits of megatron-core's GPTModel with `state` (one process, tensor/pipeline parallel size 1)."""
    import_megatron_on_cpu("megatron.core")
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel as MegatronGPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel()
    # dropout is 0; its CUDA RNG tracker fork has no CPU counterpart
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    config = TransformerConfig(
        num_layers=CONFIG.num_layers,
        hidden_size=CONFIG.hidden_size,
        num_attention_heads=CONFIG.num_attention_heads,
        num_query_groups=CONFIG.num_query_groups,
        ffn_hidden_size=CONFIG.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=CONFIG.layernorm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )
    model = MegatronGPTModel(
        config,
        get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=CONFIG.vocab_size,
        max_sequence_length=CONFIG.seq_length,
        position_embedding_type="rope",
        rotary_base=CONFIG.rotary_base,
        share_embeddings_and_output_weights=False,
    )
    model.load_state_dict(state, strict=True)
    model.eval()
    seq = tokens.shape[1]
    causal = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)  # True: masked
    with torch.no_grad():
        return model(tokens, torch.arange(seq).expand_as(tokens), causal)


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
            state[f"decoder.layers.{layer}.{LOCAL_SPEC_NAMES.get(name, name)}"] = layer_tensor
    return state


def test_megatron_core_gpt_model_gives_our_logits(tmp_path):
    torch.manual_seed(0)
    ours = GPT(CONFIG)
    with torch.no_grad():
        for param in ours.parameters():
            param.normal_(std=0.05)  # norms too
    checkpoint = tmp_path / "ours"
    weights_dir(checkpoint).mkdir(parents=True)
    state = {
        f"module.{k}": ShardedTensor.from_rank_offsets(f"module.{k}", v, replica_id=0)
        for k, v in ours.state_dict().items()
    }
    dist_checkpointing.save({"state_dict": state}, weights_dir(checkpoint))
    save_context(checkpoint, model=GPTModel(CONFIG))
    exported = export_ckpt(str(checkpoint), str(tmp_path / "mcore"), target="megatron")
    megatron_state = per_layer_local_spec(dist_checkpointing.load_plain_tensors(weights_dir(exported)))
    tokens = torch.randint(CONFIG.vocab_size, (2, 16))
    [logits] = run_distributed(megatron_logits, 1, megatron_state, tokens)
    with torch.no_grad():
        expected = ours(tokens)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
