"""Model FLOPs of a GPT training step and the peak FLOP/s of a device, for TFLOP/s and MFU.

Model FLOPs count the matrix multiplications of one forward and backward pass, as Megatron-LM (Narayanan et al.,
2021) and PaLM (Chowdhery et al., 2022, appendix B) do for MFU. Per token, with `L` layers, hidden size `h`, FFN
size `f`, query width `q = num_attention_heads * head_dim` (h, unless `kv_channels` says otherwise), key/value
width `kv = num_query_groups * head_dim`, sequence length `s` and vocabulary `V`:

    forward  = 2 * N + 4 * L * s * q        N = L * (h * (q + 2 * kv) + q * h + 3 * h * f) + h * V
    training = 3 * forward                  backward = 2 * forward (gradients of inputs and of weights)

`N` is the number of weights used in matrix multiplications: query, key/value and output projections, the
three matrices of the SwiGLU MLP, the output layer (also when tied to the embedding); the embedding lookup and
norms do no matrix multiplication. `4 * L * s * q` is attention itself (scores `Q K^T` and `softmax @ V`, two
FLOPs per multiply-add) over the whole `s x s` score matrix, causal mask or not, like `torch.utils.flop_counter`
counts `scaled_dot_product_attention`. Activation recomputation is not counted (model FLOPs, not hardware FLOPs).
"""

import torch
from lightning.fabric.utilities.throughput import get_available_flops

from nemo_ckpt.models.gpt.model import GPTConfig
from nemo_ckpt.models.gpt.moe import active_mlp_weights

# Dense (no sparsity) bf16/fp16 tensor-core peak FLOP/s of data-center GPUs, from NVIDIA's data sheets, longest
# name first; other devices fall back to Lightning's table (`get_available_flops`).
DENSE_16BIT_PEAK_FLOPS: dict[str, float] = {
    "gb200": 2.5e15,
    "b200": 2.25e15,
    "h100 pcie": 756e12,
    "h200": 989e12,
    "h100": 989e12,
    "h800": 989e12,
    "a100": 312e12,
    "a800": 312e12,
    "l40s": 362e12,
}
SIXTEEN_BIT_PRECISIONS = ("bf16-mixed", "bf16-true", "bf16", "16-mixed", "16-true", "16")


def matmul_weights(config: GPTConfig) -> int:
    """`N`: weights used in matrix multiplications (no embedding lookup, no norms)."""
    h = config.hidden_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_query_groups * config.head_dim
    per_layer = h * (q + 2 * kv) + q * h
    return config.num_layers * per_layer + active_mlp_weights(config) + h * config.vocab_size


def training_flops_per_token(config: GPTConfig) -> int:
    """Forward + backward model FLOPs per token of a `config.seq_length`-long sequence."""
    attention = 4 * config.num_layers * config.seq_length * config.num_attention_heads * config.head_dim
    return 3 * (2 * matmul_weights(config) + attention)


def training_flops_per_step(config: GPTConfig, global_batch_size: int) -> int:
    """Model FLOPs of one optimizer step over `global_batch_size` sequences of `config.seq_length` tokens."""
    return training_flops_per_token(config) * config.seq_length * global_batch_size


def peak_flops_per_device(device: torch.device, precision: str) -> float | None:
    """Peak matmul FLOP/s of `device` at Lightning `precision` ("bf16-mixed", "32-true", ...); None on CPU or
    for a GPU in neither table (then give `NeMoLogger(peak_tflops_per_device=...)` for MFU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    if str(precision) in SIXTEEN_BIT_PRECISIONS:
        for chip, flops in DENSE_16BIT_PEAK_FLOPS.items():
            if chip in name:
                return flops
        return get_available_flops(device, torch.bfloat16 if "bf16" in str(precision) else torch.float16)
    flops = get_available_flops(device, torch.float32)
    return None if flops is None else float(flops)
