"""megatron-core's own GPTModel (local spec, on CPU) built from a `GPTConfig`, and a torchrun entry point that runs it
with megatron-core's own `dist_checkpointing` (one megatron-core version on the path,
`tests/helpers/megatron.py:torchrun`):

    megatron_core_gpt_worker.py LOAD_DIR SAVE_DIR

loads the checkpoint under LOAD_DIR/weights into the model's `sharded_state_dict(prefix="module.")` with
megatron-core's default strictness and writes its logits on `TOKENS` to LOAD_DIR/megatron_logits.pt; then saves a
fresh random model as a plain megatron-core checkpoint (`sharded_state_dict()`, no prefix) to SAVE_DIR/weights,
with its logits in SAVE_DIR/megatron_logits.pt. The model's shape is `CONFIG`.
"""

import contextlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nemo_ckpt.models import GPTConfig, gpt_config
from tests.helpers.megatron import import_megatron_on_cpu

CONFIG = gpt_config("tiny", num_attention_heads=4, num_query_groups=2, num_layers=2)
TOKENS = torch.arange(32).remainder(CONFIG.vocab_size).view(2, 16)


def build_model(ours: GPTConfig):
    """megatron-core's GPTModel with the shape and options of `ours` (model-parallel state initialized)."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    # dropout is 0; its CUDA RNG tracker fork has no CPU counterpart
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    config = TransformerConfig(
        num_layers=ours.num_layers,
        hidden_size=ours.hidden_size,
        num_attention_heads=ours.num_attention_heads,
        num_query_groups=ours.num_query_groups,
        kv_channels=ours.head_dim,
        ffn_hidden_size=ours.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=ours.layernorm_epsilon,
        add_qkv_bias=ours.add_qkv_bias,
        qk_layernorm=ours.qk_layernorm,
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
        **moe_options(ours),
    )
    spec = get_gpt_layer_local_spec(
        num_experts=ours.num_moe_experts,
        moe_grouped_gemm=False,
        normalization="RMSNorm",
        qk_layernorm=ours.qk_layernorm,
    )
    return GPTModel(
        config,
        spec,
        vocab_size=ours.vocab_size,
        max_sequence_length=ours.seq_length,
        position_embedding_type="rope",
        rotary_base=ours.rotary_base,
        rope_scaling=ours.rope_scaling,
        share_embeddings_and_output_weights=False,
    ).eval()


def moe_options(ours: GPTConfig) -> dict:
    """megatron-core's MoE options for `ours` (none for a dense model): the all-gather dispatcher runs on CPU."""
    if not ours.num_moe_experts:
        return {}
    return {
        "num_moe_experts": ours.num_moe_experts,
        "moe_router_topk": ours.moe_router_topk,
        "moe_ffn_hidden_size": ours.moe_ffn_hidden_size or ours.ffn_hidden_size,
        "moe_token_dispatcher_type": "allgather",
    }


def logits(model, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    seq = tokens.shape[1]
    causal = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)  # True: masked
    with torch.no_grad():
        return model(tokens, torch.arange(seq).expand_as(tokens), causal)


def main(load_dir: Path, save_dir: Path) -> None:
    dist.init_process_group("gloo")
    import_megatron_on_cpu("megatron.core")
    from megatron.core import dist_checkpointing, parallel_state

    parallel_state.initialize_model_parallel()
    model = build_model(CONFIG)
    state = dist_checkpointing.load(model.sharded_state_dict(prefix="module."), str(load_dir / "weights"))
    model.load_state_dict({key.removeprefix("module."): value for key, value in state.items()})
    torch.save(logits(model), load_dir / "megatron_logits.pt")
    torch.manual_seed(1)
    fresh = build_model(CONFIG)
    with torch.no_grad():
        for param in fresh.parameters():
            param.normal_(std=0.05)
    (save_dir / "weights").mkdir(parents=True)
    dist_checkpointing.save(fresh.sharded_state_dict(), str(save_dir / "weights"))
    torch.save(logits(fresh), save_dir / "megatron_logits.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
