"""`clip_grad_norm` on FSDP2-sharded (DTensor) gradients equals torch's clipping in one process, with one
all-reduce."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.profiler import profile

from nemo_ckpt.models import gpt_config
from nemo_ckpt.models.gpt import GPT
from nemo_ckpt.optim import clip_grad_norm
from nemo_ckpt.parallel.ddp_config import DistributedDataParallelConfig
from nemo_ckpt.parallel.fsdp import apply_fsdp
from tests.helpers.distributed import run_distributed

BATCH = 4
MAX_NORMS = (1e-2, 1e3)  # one clips, one leaves the gradients as they are


def model_and_batch() -> tuple[GPT, torch.Tensor]:
    torch.manual_seed(0)
    config = gpt_config("tiny")
    return GPT(config), torch.randint(0, config.vocab_size, (BATCH, config.seq_length + 1))


def backward(model: GPT, tokens: torch.Tensor) -> None:
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def clip_sharded(rank: int, world_size: int) -> list[dict]:
    """Per max norm: the returned norm, the clipped full gradients, and the number of all-reduces it ran."""
    results = []
    for max_norm in MAX_NORMS:
        model, tokens = model_and_batch()
        config = DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads_params")
        apply_fsdp([model], init_device_mesh("cpu", (world_size,)), config, torch.device("cpu"))
        backward(model, tokens.chunk(world_size)[rank])  # FSDP2 averages: the gradient of the whole batch
        assert all(isinstance(param.grad, DTensor) for param in model.parameters())
        with profile() as prof:
            norm = clip_grad_norm(model.parameters(), max_norm)
        all_reduces = sum(event.count for event in prof.key_averages() if event.key == "c10d::allreduce_")
        grads = {name: full(param.grad) for name, param in model.named_parameters()}
        results.append({"norm": norm, "grads": grads, "all_reduces": all_reduces})
    return results


def clip_single_process() -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    results = []
    for max_norm in MAX_NORMS:
        model, tokens = model_and_batch()
        backward(model, tokens)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        results.append((norm, {name: param.grad for name, param in model.named_parameters()}))
    return results


def test_clipping_sharded_gradients_equals_single_process_clipping():
    per_rank = run_distributed(clip_sharded, 2)
    for max_norm, (expected_norm, expected_grads), *ranks in zip(MAX_NORMS, clip_single_process(), *per_rank):
        for result in ranks:
            assert type(result["norm"]) is torch.Tensor, "a plain tensor, not a DTensor"
            assert result["norm"].item() == pytest.approx(expected_norm.item(), rel=1e-5)
            assert result["grads"].keys() == expected_grads.keys()
            for name, grad in result["grads"].items():
                torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-8, msg=name)
            clipped_norm = torch.linalg.vector_norm(torch.stack([grad.norm() for grad in result["grads"].values()]))
            assert clipped_norm.item() == pytest.approx(min(max_norm, expected_norm.item()), rel=1e-4)
            assert result["all_reduces"] == 1, "one all-reduce for the total norm, not one per parameter"
