"""Tensor and sequence parallelism for `GPT` on DTensor (Megatron's column/row-parallel linears).

The plan follows Megatron-Core and torchtitan: q/k/v and gate/up projections are column-parallel (weights
`Shard(0)` over `tp`), o/down projections row-parallel (`Shard(1)`), the embedding is vocab-parallel and the
output layer column-parallel with its logits gathered. With `sequence_parallel`, norms run on sequence shards
(`SequenceParallel`) and activations between blocks stay sharded on the sequence dimension; without it, norms
hold `Replicate` weights. Every parameter becomes a DTensor on the `tp` mesh, so FSDP (`fully_shard` on the
`dp` mesh) composes on top and gradient clipping sees one mesh.

    mesh = build_device_mesh("cpu", tensor_model_parallel_size=2)
    parallelize_gpt(model, mesh["tp"], sequence_parallel=True)
"""

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from nemo_ckpt.models.gpt import GPT, GPTConfig
from nemo_ckpt.parallel.meta_init import materialize

DATA_PARALLEL_DIM = "dp"
TENSOR_PARALLEL_DIM = "tp"


def build_device_mesh(device_type: str, tensor_model_parallel_size: int, world_size: int | None = None) -> DeviceMesh:
    """A 2-D (dp, tp) mesh over all ranks; tp ranks are adjacent (fastest links), as in Megatron-Core."""
    world_size = world_size or dist.get_world_size()
    if tensor_model_parallel_size < 1 or world_size % tensor_model_parallel_size:
        raise ValueError(
            f"tensor_model_parallel_size={tensor_model_parallel_size} must be >= 1 and divide the world size "
            f"{world_size}; choose a divisor of the number of processes"
        )
    shape = (world_size // tensor_model_parallel_size, tensor_model_parallel_size)
    return init_device_mesh(device_type, shape, mesh_dim_names=(DATA_PARALLEL_DIM, TENSOR_PARALLEL_DIM))


def validate_tensor_parallel(config: GPTConfig, tensor_model_parallel_size: int, sequence_parallel: bool) -> None:
    """Raise one clear error if `config` cannot be split `tensor_model_parallel_size` ways."""
    tp = tensor_model_parallel_size
    if tp < 1:
        raise ValueError(f"tensor_model_parallel_size={tp} must be >= 1")
    if sequence_parallel and tp == 1:
        raise ValueError("sequence_parallel=True needs tensor_model_parallel_size > 1; set sequence_parallel=False")
    divisible = {
        "num_attention_heads": config.num_attention_heads,
        "num_query_groups": config.num_query_groups,
        "ffn_hidden_size": config.ffn_hidden_size,
        "vocab_size": config.vocab_size,
    }
    if sequence_parallel:
        divisible["seq_length"] = config.seq_length
    for name, value in divisible.items():
        if value % tp:
            raise ValueError(
                f"GPTConfig.{name}={value} is not divisible by tensor_model_parallel_size={tp}: each tensor-parallel "
                f"rank holds {name} / {tp}; choose a tensor_model_parallel_size that divides it"
            )


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
        return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                     if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)

    def _prepare_output(self, module: nn.Module, output: DTensor, mesh: DeviceMesh) -> torch.Tensor:
        return output.to_local() if self.use_local_output else output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._replicate_params, self._prepare_input,
                                 self._prepare_output)


def tensor_parallel_plan(config: GPTConfig, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Parallel styles for `GPT`'s modules, keyed by module path (`*` matches each layer)."""
    activations = Shard(1) if sequence_parallel else Replicate()

    def norm(use_local_output: bool = False) -> ParallelStyle:
        if sequence_parallel:
            return SequenceParallel(use_local_output=use_local_output)
        return ReplicateParallel(use_local_output=use_local_output)

    def gather_input(num_inputs: int) -> ParallelStyle:
        return PrepareModuleInput(input_layouts=(activations,) + (None,) * (num_inputs - 1),
                                  desired_input_layouts=(Replicate(),) + (None,) * (num_inputs - 1),
                                  use_local_output=True)

    plan: dict[str, ParallelStyle] = {
        "embedding": RowwiseParallel(input_layouts=Replicate(), output_layouts=activations),
        "layers.*.input_layernorm": norm(),
        "layers.*.self_attention": gather_input(num_inputs=3),
        "layers.*.self_attention.q_proj": ColwiseParallel(),
        "layers.*.self_attention.k_proj": ColwiseParallel(),
        "layers.*.self_attention.v_proj": ColwiseParallel(),
        "layers.*.self_attention.o_proj": RowwiseParallel(output_layouts=activations),
        "layers.*.pre_mlp_layernorm": norm(),
        "layers.*.mlp": gather_input(num_inputs=1),
        "layers.*.mlp.gate_proj": ColwiseParallel(),
        "layers.*.mlp.up_proj": ColwiseParallel(),
        "layers.*.mlp.down_proj": RowwiseParallel(output_layouts=activations),
    }
    if config.share_embeddings_and_output_weights:
        # logits = final_norm(x) @ embedding.weight.T: DTensor math gives vocab-sharded logits, gathered below
        plan["final_layernorm"] = norm(use_local_output=False)
    else:
        plan["final_layernorm"] = norm()
        plan["output_layer"] = ColwiseParallel(input_layouts=activations, output_layouts=Replicate())
    return plan


def parallelize_gpt(model: GPT, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> GPT:
    """Apply tensor (and sequence) parallelism to `model` in place; logits come out whole on every tp rank.

    Attention runs on `num_attention_heads / tp` local heads and `num_query_groups / tp` local groups. Call it
    on identically initialized replicas (same seed), before `fully_shard` on the `dp` mesh.
    """
    validate_tensor_parallel(model.config, tp_mesh.size(), sequence_parallel)
    parallelize_module(model, tp_mesh, tensor_parallel_plan(model.config, sequence_parallel))
    if model.config.share_embeddings_and_output_weights:
        parallelize_module(model, tp_mesh, PrepareModuleOutput(output_layouts=Shard(-1),
                                                               desired_output_layouts=Replicate()))
    return model


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool,
                          device: torch.device) -> None:
    """Parallelize every `GPT` inside `model` (e.g. a `GPTModel`'s `module`) over `tp_mesh`, in place.

    A GPT still on `meta` is first materialized whole on `device`: its shards then hold the values an eager
    build has (on CPU, DTensor random init would give every tp rank the same shard).
    """
    gpts = [module for module in model.modules() if isinstance(module, GPT)]
    if not gpts:
        raise TypeError(f"tensor_model_parallel_size={tp_mesh.size()} needs a nemo_ckpt GPT inside "
                        f"{type(model).__name__}; found none")
    for gpt in gpts:
        materialize(gpt, device)
        parallelize_gpt(gpt, tp_mesh, sequence_parallel)


class GradientAllReducer:
    """Data parallelism for tensor-parallel DTensor parameters, whose gradients DDP cannot reduce: averages each
    gradient's local shard over the data-parallel `group`.

    With `overlap_grad_reduce`, a gradient's all-reduce starts as soon as backward has accumulated it (one
    parameter per bucket) and `finish()` waits for them; without, `finish()` reduces all gradients in one
    coalesced all-reduce. Call `finish()` after every backward; averaging again after gradient accumulation
    is exact, as the reduced part is already equal on every rank.
    """

    def __init__(self, module: nn.Module, group: dist.ProcessGroup, overlap_grad_reduce: bool) -> None:
        self.module = module
        self.group = group
        self.pending: list[tuple[torch.Tensor, dist.Work]] = []
        if overlap_grad_reduce:
            for param in module.parameters():
                if param.requires_grad:
                    param.register_post_accumulate_grad_hook(self._start_all_reduce)

    @staticmethod
    def _local(grad: torch.Tensor) -> torch.Tensor:
        return grad.to_local() if isinstance(grad, DTensor) else grad

    def _start_all_reduce(self, param: torch.Tensor) -> None:
        grad = self._local(param.grad)
        self.pending.append((grad, dist.all_reduce(grad, group=self.group, async_op=True)))

    @torch.no_grad()
    def finish(self) -> None:
        """Complete the averaging of every gradient."""
        if self.pending:
            for grad, work in self.pending:
                work.wait()
                grad.div_(self.group.size())
            self.pending.clear()
            return
        grads = [self._local(param.grad) for param in self.module.parameters() if param.grad is not None]
        if not grads:
            return
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.group)
        flat.div_(self.group.size())
        for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            grad.copy_(reduced)
