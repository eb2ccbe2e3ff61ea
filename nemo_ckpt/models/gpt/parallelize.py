"""The GPT's tensor and sequence parallel plan on DTensor (Megatron's column/row-parallel linears).

The plan follows Megatron-Core and torchtitan: q/k/v and gate/up projections are column-parallel (weights
`Shard(0)` over `tp`), o/down projections row-parallel (`Shard(1)`), the embedding is vocab-parallel and the
output layer column-parallel with its logits gathered. With `sequence_parallel`, norms run on sequence shards
(`SequenceParallel`) and activations between blocks stay sharded on the sequence dimension; without it, norms
hold `Replicate` weights. A linear layer carrying LoRA adapters places them like Megatron-Core (see
`LoRALinear.tensor_parallel_placements`); q/k/v biases are split with their weights; the per-head q/k norms
(`qk_layernorm`) hold replicated weights and run on the local heads. Every parameter becomes a DTensor on the `tp`
mesh, so FSDP (`fully_shard` on the `dp` mesh) composes on top and gradient clipping sees one mesh.

A mixture-of-experts layer (`MoELayer`) gets its input gathered like the dense MLP; its router is replicated,
its shared expert is split like the dense MLP, and its routed experts are split the same way with their outputs
left as partial sums (`expert_tensor_parallel`) or replicated whole (`moe_layer_plan`).

    mesh = build_device_mesh("cpu", tensor_model_parallel_size=2)
    parallelize_gpt(model, mesh["tp"], sequence_parallel=True)
"""

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from nemo_ckpt.models.gpt.model import GPT, GPTConfig
from nemo_ckpt.models.gpt.moe import MoELayer
from nemo_ckpt.parallel.tensor_parallel import ReplicateParallel


def _distribute_with_adapters(apply, style: str, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
    """Run the linear style `apply` on `module`'s base weight, then place the parameters the module declares with
    `tensor_parallel_placements(style)` (LoRA adapters) as it asks."""
    placements = module.tensor_parallel_placements(style) if hasattr(module, "tensor_parallel_placements") else {}
    extras = {name: getattr(module, name) for name in placements}
    for name in extras:
        delattr(module, name)
    apply(module, device_mesh)
    for name, param in extras.items():
        placed = distribute_tensor(param.detach(), device_mesh, [placements[name]])
        module.register_parameter(name, nn.Parameter(placed, requires_grad=param.requires_grad))
    return module


class LinearColwiseParallel(ColwiseParallel):
    """`ColwiseParallel` that also places a layer's adapters (`tensor_parallel_placements("colwise")`)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return _distribute_with_adapters(super()._apply, "colwise", module, device_mesh)


class LinearRowwiseParallel(RowwiseParallel):
    """`RowwiseParallel` that also places a layer's adapters (`tensor_parallel_placements("rowwise")`)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return _distribute_with_adapters(super()._apply, "rowwise", module, device_mesh)


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


def tensor_parallel_plan(config: GPTConfig, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Parallel styles for `GPT`'s modules, keyed by module path (`*` matches each layer)."""
    activations = Shard(1) if sequence_parallel else Replicate()

    def norm(use_local_output: bool = False) -> ParallelStyle:
        if sequence_parallel:
            return SequenceParallel(use_local_output=use_local_output)
        return ReplicateParallel(use_local_output=use_local_output)

    def gather_input(num_inputs: int) -> ParallelStyle:
        return PrepareModuleInput(
            input_layouts=(activations,) + (None,) * (num_inputs - 1),
            desired_input_layouts=(Replicate(),) + (None,) * (num_inputs - 1),
            use_local_output=True,
        )

    plan: dict[str, ParallelStyle] = {
        "embedding": RowwiseParallel(input_layouts=Replicate(), output_layouts=activations),
        "layers.*.input_layernorm": norm(),
        "layers.*.self_attention": gather_input(num_inputs=3),
        "layers.*.self_attention.q_proj": LinearColwiseParallel(),
        "layers.*.self_attention.k_proj": LinearColwiseParallel(),
        "layers.*.self_attention.v_proj": LinearColwiseParallel(),
        "layers.*.self_attention.o_proj": LinearRowwiseParallel(output_layouts=activations),
        "layers.*.pre_mlp_layernorm": norm(),
        "layers.*.mlp": gather_input(num_inputs=1),
        "layers.*.mlp.gate_proj": LinearColwiseParallel(),
        "layers.*.mlp.up_proj": LinearColwiseParallel(),
        "layers.*.mlp.down_proj": LinearRowwiseParallel(output_layouts=activations),
    }
    if config.share_embeddings_and_output_weights:
        # logits = final_norm(x) @ embedding.weight.T: DTensor math gives vocab-sharded logits, gathered below
        plan["final_layernorm"] = norm(use_local_output=False)
    else:
        plan["final_layernorm"] = norm()
        plan["output_layer"] = LinearColwiseParallel(input_layouts=activations, output_layouts=Replicate())
    if config.qk_layernorm:  # on this rank's heads: a replicated weight, its gradient summed over the heads of all
        for name in ("q_layernorm", "k_layernorm"):
            plan[f"layers.*.self_attention.{name}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    if config.num_moe_experts:  # dense and MoE layers: each layer's MLP gets the plan of its kind
        plan = {path: style for path, style in plan.items() if not path.startswith("layers.*.mlp")}
        plan["layers.*.mlp"] = FeedForwardParallel(activations)
    return plan


def moe_layer_plan(layer: MoELayer, tp_size: int, activations: Placement) -> dict[str, ParallelStyle]:
    """Parallel styles inside a `MoELayer` whose input is gathered over tp: a replicated router, a shared expert
    split like the dense MLP, routed experts split the same way with partial-sum outputs (reduced by the layer,
    `MoELayer.set_tensor_parallel`) or, without `expert_tensor_parallel`, replicated whole."""
    config = layer.config
    sizes = {"moe_shared_expert_intermediate_size": config.moe_shared_expert_intermediate_size or 0}
    if layer.expert_tensor_parallel:
        sizes = {"moe_ffn_hidden_size": config.moe_ffn_hidden_size or config.ffn_hidden_size, **sizes}
    for name, size in sizes.items():
        if size % tp_size:
            raise ValueError(
                f"GPTConfig.{name}={size} is not divisible by tensor_model_parallel_size={tp_size}: each "
                f"tensor-parallel rank holds {name} / {tp_size} of the expert; choose sizes that divide it"
                + (", or set expert_tensor_parallel_size=1" if name == "moe_ffn_hidden_size" else "")
            )
    experts: dict[str, ParallelStyle] = {
        "gate_proj": LinearColwiseParallel(),
        "up_proj": LinearColwiseParallel(),
        "down_proj": LinearRowwiseParallel(output_layouts=Partial()),
    }
    if not layer.expert_tensor_parallel:
        experts = {name: ReplicateParallel() for name in experts}
    plan = {"router": ReplicateParallel(), **{f"experts.*.{name}": style for name, style in experts.items()}}
    if layer.shared_experts is not None:
        plan["shared_experts.gate_proj"] = LinearColwiseParallel()
        plan["shared_experts.up_proj"] = LinearColwiseParallel()
        plan["shared_experts.down_proj"] = LinearRowwiseParallel(output_layouts=activations)
    return plan


class FeedForwardParallel(ParallelStyle):
    """A transformer layer's MLP, dense or `MoELayer`: its input gathered over tp, then the plan of its kind;
    its output in `activations` (`Shard(1)` with sequence parallelism, else `Replicate`)."""

    def __init__(self, activations: Placement) -> None:
        super().__init__()
        self.activations = activations

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        gather = PrepareModuleInput(
            input_layouts=(self.activations,), desired_input_layouts=(Replicate(),), use_local_output=True
        )
        parallelize_module(module, device_mesh, gather)
        if not isinstance(module, MoELayer):
            plan = {
                "gate_proj": LinearColwiseParallel(),
                "up_proj": LinearColwiseParallel(),
                "down_proj": LinearRowwiseParallel(output_layouts=self.activations),
            }
            return parallelize_module(module, device_mesh, plan)
        parallelize_module(module, device_mesh, moe_layer_plan(module, device_mesh.size(), self.activations))
        module.set_tensor_parallel(device_mesh, self.activations)
        return module


def parallelize_gpt(model: GPT, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> GPT:
    """Apply tensor (and sequence) parallelism to `model` in place; logits come out whole on every tp rank.

    Attention runs on `num_attention_heads / tp` local heads and `num_query_groups / tp` local groups. Call it
    on identically initialized replicas (same seed), before `fully_shard` on the `dp` mesh.
    """
    validate_tensor_parallel(model.config, tp_mesh.size(), sequence_parallel)
    parallelize_module(model, tp_mesh, tensor_parallel_plan(model.config, sequence_parallel))
    if model.config.share_embeddings_and_output_weights:
        parallelize_module(
            model, tp_mesh, PrepareModuleOutput(output_layouts=Shard(-1), desired_output_layouts=Replicate())
        )
    return model
