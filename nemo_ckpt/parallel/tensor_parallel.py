"""Tensor parallelism on DTensor, for any model that brings its own plan.

A module takes part by defining `parallelize_tensor(tp_mesh, sequence_parallel)` (the GPT's plan is in
`nemo_ckpt.models.gpt.parallelize`, beside the model, as in torchtitan); `apply_tensor_parallel` calls it on
each such module of a LightningModule. `ReplicateParallel` is the style for parameters replicated over `tp`.
"""

from typing import Protocol, runtime_checkable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle

from nemo_ckpt.parallel.meta_init import materialize


@runtime_checkable
class TensorParallelizable(Protocol):
    """A module that applies its own tensor-parallel plan in place."""

    def parallelize_tensor(self, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None: ...


class ReplicateParallel(ParallelStyle):
    """Replicated parameters and activations over `tp` (norms without sequence parallelism).

    Like `SequenceParallel`, it assumes the weights are already equal on every tp rank (same seed or ones-init).
    """

    def __init__(self, *, use_local_output: bool = True) -> None:
        super().__init__()
        self.use_local_output = use_local_output

    @staticmethod
    def _replicate_params(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for param_name, param in module.named_parameters(recurse=False):
            replicated = DTensor.from_local(param.data, mesh, [Replicate()], run_check=False)
            module.register_parameter(param_name, nn.Parameter(replicated, param.requires_grad))

    @staticmethod
    def _prepare_input(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        return tuple(
            DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
            else x
            for x in inputs
        )

    def _prepare_output(self, module: nn.Module, output: DTensor, mesh: DeviceMesh) -> torch.Tensor:
        return output.to_local() if self.use_local_output else output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._replicate_params, self._prepare_input, self._prepare_output)


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool, device: torch.device) -> None:
    """Parallelize every `TensorParallelizable` module inside `model` (e.g. a `GPTModel`'s `module`) over
    `tp_mesh`, in place.

    A module still on `meta` is first materialized whole on `device`: its shards then hold the values an eager
    build has (on CPU, DTensor random init would give every tp rank the same shard).
    """
    targets = [module for module in model.modules() if isinstance(module, TensorParallelizable)]
    if not targets:
        raise TypeError(
            f"tensor_model_parallel_size={tp_mesh.size()} needs a module with a tensor-parallel plan "
            f"(a `parallelize_tensor` method, as nemo_ckpt's GPT has) inside {type(model).__name__}; "
            "found none"
        )
    for module in targets:
        materialize(module, device)
        module.parallelize_tensor(tp_mesh, sequence_parallel)
