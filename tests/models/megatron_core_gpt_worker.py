"""megatron-core's own GPTModel (local spec, on CPU) and its own `dist_checkpointing`, under torchrun with one
megatron-core version on the path (`tests/helpers/megatron.py:torchrun`):

    worker.py LOAD_DIR SAVE_DIR

loads the checkpoint under LOAD_DIR/weights into the model's `sharded_state_dict(prefix="module.")` with
megatron-core's default strictness and writes its logits on `TOKENS` to LOAD_DIR/megatron_logits.pt; then saves a
fresh random model as a plain megatron-core checkpoint (`sharded_state_dict()`, no prefix) to SAVE_DIR/weights,
with its logits in SAVE_DIR/megatron_logits.pt. The model's shape is `CONFIG` of test_megatron_core_gpt.py.
"""

import contextlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.helpers.megatron import import_megatron_on_cpu

LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB, SEQ = 2, 64, 4, 2, 172, 256, 32
TOKENS = torch.arange(32).remainder(VOCAB).view(2, 16)


def build_model():
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    tensor_parallel.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        ffn_hidden_size=FFN,
        normalization="RMSNorm",
        layernorm_epsilon=1e-5,
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
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    return GPTModel(
        config, spec, vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope", rotary_base=10000.0
    ).eval()


def logits(model) -> torch.Tensor:
    seq = TOKENS.shape[1]
    causal = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        return model(TOKENS, torch.arange(seq).expand_as(TOKENS), causal)


def main(load_dir: Path, save_dir: Path) -> None:
    dist.init_process_group("gloo")
    import_megatron_on_cpu("megatron.core")
    from megatron.core import dist_checkpointing, parallel_state

    parallel_state.initialize_model_parallel()
    model = build_model()
    state = dist_checkpointing.load(model.sharded_state_dict(prefix="module."), str(load_dir / "weights"))
    model.load_state_dict({key.removeprefix("module."): value for key, value in state.items()})
    torch.save(logits(model), load_dir / "megatron_logits.pt")
    torch.manual_seed(1)
    fresh = build_model()
    with torch.no_grad():
        for param in fresh.parameters():
            param.normal_(std=0.05)
    (save_dir / "weights").mkdir(parents=True)
    dist_checkpointing.save(fresh.sharded_state_dict(), str(save_dir / "weights"))
    torch.save(logits(fresh), save_dir / "megatron_logits.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
