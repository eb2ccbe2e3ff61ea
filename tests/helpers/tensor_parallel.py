"""Shared pieces of the tensor-parallel tests: a tiny GPT on a (dp, tp) mesh, its data and a training step."""

from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from nemo_ckpt.data.mock import ArithmeticSequences
from nemo_ckpt.models.gpt import GPT, GPTConfig, parallelize_gpt
from nemo_ckpt.parallel.gradients import GradientAllReducer
from nemo_ckpt.parallel.mesh import build_device_mesh

GLOBAL_BATCH_SIZE = 8


def global_batches(config: GPTConfig, steps: int, first_step: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The same (tokens, labels) global batches for every layout."""
    dataset = ArithmeticSequences(
        (first_step + steps) * GLOBAL_BATCH_SIZE, config.seq_length, config.vocab_size, seed=1234
    )
    for step in range(first_step, first_step + steps):
        samples = [dataset[step * GLOBAL_BATCH_SIZE + i] for i in range(GLOBAL_BATCH_SIZE)]
        yield torch.stack([s["tokens"] for s in samples]), torch.stack([s["labels"] for s in samples])


class ParallelModel(NamedTuple):
    model: GPT
    dp_rank: int
    dp_size: int
    grad_reducer: GradientAllReducer | None


def build_model(config: GPTConfig, tensor_parallel: int, sequence_parallel: bool, fsdp: bool) -> ParallelModel:
    """A GPT (seed 0 init) with TP on the `tp` mesh and, over the `dp` mesh, `fully_shard` per layer with `fsdp`,
    else (dp > 1) gradients averaged by a `GradientAllReducer`."""
    torch.manual_seed(0)
    model = GPT(config)
    if not dist.is_initialized():
        return ParallelModel(model, 0, 1, None)
    mesh = build_device_mesh("cpu", tensor_parallel)
    dp_mesh = mesh["dp"]
    if tensor_parallel > 1:
        parallelize_gpt(model, mesh["tp"], sequence_parallel)
    grad_reducer = None
    if fsdp:
        for layer in model.layers:
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    elif dp_mesh.size() > 1:
        grad_reducer = GradientAllReducer(model, dp_mesh.get_group(), overlap_grad_reduce=False)
    return ParallelModel(model, dp_mesh.get_local_rank(), dp_mesh.size(), grad_reducer)


def train(parallel: ParallelModel, optimizer: torch.optim.Optimizer, batches: Iterator) -> list[float]:
    """Train on this rank's slice of each global batch; returns the global-batch mean loss of each step."""
    model, dp_rank, dp_size, grad_reducer = parallel
    losses = []
    for tokens, labels in batches:
        micro = tokens.shape[0] // dp_size
        rows = slice(dp_rank * micro, (dp_rank + 1) * micro)
        logits = model(tokens[rows])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels[rows].flatten())
        loss.backward()
        if grad_reducer is not None:
            grad_reducer.finish()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(_mean_over_ranks(loss.detach()))
    return losses


def _mean_over_ranks(value: torch.Tensor) -> float:
    if not dist.is_initialized():
        return value.item()
    value = value.clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of the whole tensor (collective for a DTensor; `full_tensor()` of a replicated one is an alias)."""
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def full_model_and_optimizer_state(model: GPT, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Whole weights, and Adam's moments and step per parameter name, for comparisons across layouts."""
    names = {param: name for name, param in model.named_parameters()}
    state = {f"model.{name}": full(value) for name, value in model.state_dict().items()}
    for param, param_state in optimizer.state.items():
        for key, value in param_state.items():
            state[f"optimizer.{key}.{names[param]}"] = full(value)
    return state
