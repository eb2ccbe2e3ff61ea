"""Generation on several processes: the model split by the GPT's tensor-parallel plan and/or into pipeline stages,
each rank loading its part of any checkpoint (resharded by `dist_checkpointing`).

Every rank runs the same generation loop on the same prompts: under tensor parallelism each rank computes its
heads and the output layer's logits are gathered; under pipeline parallelism a stage receives the hidden states of
the one before it and sends its own to the next (point-to-point), and the last stage broadcasts the logits of the
new tokens, so every rank picks the same tokens (sampling with the same seed).
"""

import fiddle as fdl
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from nemo_ckpt import dist_checkpointing
from nemo_ckpt.checkpoint.context import load_model, load_model_config
from nemo_ckpt.checkpoint.layout import weights_dir
from nemo_ckpt.models.gpt.kv_cache import KVCache
from nemo_ckpt.models.gpt.lightning import GPTModel
from nemo_ckpt.models.gpt.model import GPT
from nemo_ckpt.strategy.state_dict import load_module_state, model_sharded_state_dict


def load_generation_model(
    checkpoint: str, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, device: str = "cpu"
) -> GPTModel:
    """`checkpoint`'s model in this process on `device`, or with more than one of tensor x pipeline parallel
    ranks this rank's part (`load_parallel_model`); the process group (gloo, NCCL on CUDA) starts from torchrun's
    environment unless it is already up."""
    if tensor_parallel_size * pipeline_parallel_size == 1:
        return load_model(checkpoint).eval().to(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    if device == "cuda":
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    return load_parallel_model(checkpoint, tensor_parallel_size, pipeline_parallel_size, device)


def load_parallel_model(
    checkpoint: str, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, device: str = "cpu"
) -> GPTModel:
    """This rank's part of `checkpoint`'s model over a (pipeline, tensor) mesh of all ranks, with its weights
    (an adapter checkpoint's base weights from its base checkpoint). Needs an initialized process group of
    `tensor_parallel_size x pipeline_parallel_size` ranks."""
    world = dist.get_world_size()
    if tensor_parallel_size * pipeline_parallel_size != world:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} x pipeline_parallel_size={pipeline_parallel_size} must "
            f"equal the {world} processes started (e.g. torchrun --nproc-per-node)"
        )
    mesh = init_device_mesh(device, (pipeline_parallel_size, tensor_parallel_size), mesh_dim_names=("pp", "tp"))
    model = fdl.build(load_model_config(checkpoint))
    with torch.device(device):
        model.configure_model()
    if pipeline_parallel_size > 1:
        model.split_pipeline(mesh["pp"], virtual_size=1)
    if tensor_parallel_size > 1:
        model.parallelize_tensor(mesh["tp"], sequence_parallel=False)
    state = torch.nn.Module.state_dict(model)  # with a LoRA model's base weights
    peft = model.peft
    own = {key: value for key, value in state.items() if peft is None or peft.is_adapter_key(key)}
    loaded = _load_sharded(own, checkpoint)
    if peft is not None:
        base = {key: value for key, value in state.items() if key not in own}
        loaded |= _load_sharded(base, peft.base_checkpoint)
    load_module_state(model, loaded)
    return model.eval()


def _load_sharded(state: dict[str, torch.Tensor], checkpoint: str) -> dict[str, torch.Tensor]:
    """This rank's shards of `state`'s tensors, read from `checkpoint` whatever layout saved it."""
    sharded = model_sharded_state_dict(state, replica_id=0)
    return dist_checkpointing.load(sharded, weights_dir(checkpoint), validate_access_integrity=False)


class PipelineForward:
    """The logits of the last new token of each row, from this rank's pipeline stage: hidden states come from the
    previous stage and go to the next (`send`/`recv` over the pipeline group), logits are broadcast from the last.
    """

    def __init__(self, model: GPTModel) -> None:
        if len(model.pipeline_stages) != 1:
            raise ValueError("generation runs one pipeline stage per rank: use virtual_pipeline_model_parallel_size=1")
        self.stage: GPT = model.pipeline_stages[0][1]
        self.group = model.pipeline_group
        self.ranks = dist.get_process_group_ranks(self.group)
        self.index = self.ranks.index(dist.get_rank())

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
        config = self.stage.config
        x = tokens
        if not self.stage.pre_process:
            dtype = next(self.stage.parameters()).dtype
            x = torch.empty(*tokens.shape, config.hidden_size, dtype=dtype, device=tokens.device)
            dist.recv(x, src=self.ranks[self.index - 1], group=self.group)
        out = self.stage(x, positions, kv_cache=kv_cache)
        if not self.stage.post_process:
            dist.send(out.contiguous(), dst=self.ranks[self.index + 1], group=self.group)
            logits = torch.empty(tokens.shape[0], config.vocab_size, dtype=out.dtype, device=out.device)
        else:
            logits = out[:, -1].contiguous()
        dist.broadcast(logits, src=self.ranks[-1], group=self.group)
        return logits
