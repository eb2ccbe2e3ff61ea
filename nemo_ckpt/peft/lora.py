"""LoRA (low-rank adapters, Hu et al. 2021) for the GPT's linear layers, like NeMo's `llm.peft.LoRA`.

`LoRA(...).apply(module)` freezes every parameter and turns each targeted linear layer into a `LoRALinear`: the
same module path and base `weight` (so base checkpoints load unchanged), plus `lora_a` [dim, in] and `lora_b`
[out, dim], with `y = x W^T + (alpha / dim) * dropout(x) A^T B^T`. `lora_b` starts at zero, so training starts
from the base model. A `GPTModel(peft=LoRA(...))` saves and resumes only the adapters; `nemo_ckpt.peft.merge`
folds them into the base weights.
"""

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Placement, Replicate, Shard

ADAPTER_PARAMS = ("lora_a", "lora_b")

# Megatron-Core / NeMo target names -> the GPT's linear layers they fuse.
MEGATRON_TARGETS = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}


class LoRALinear(nn.Linear):
    """A frozen linear layer (its bias, if any, frozen too: Qwen2's q/k/v) with a trainable low-rank update."""

    def __init__(self, base: nn.Linear, dim: int, alpha: float, dropout: float) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.init_std = getattr(base, "init_std", None)
        self.weight = base.weight
        self.weight.requires_grad_(False)
        self.bias = base.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)
        factory = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_a = nn.Parameter(torch.empty(dim, self.in_features, **factory))
        self.lora_b = nn.Parameter(torch.empty(self.out_features, dim, **factory))
        self.scale = alpha / dim
        self.dropout = dropout  # a float, not an `nn.Dropout` child: TP styles partition every child module
        if not base.weight.is_meta:
            self.reset_adapters()

    @torch.no_grad()
    def reset_adapters(self) -> None:
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b)

    def reset_parameters(self) -> None:
        if self.init_std is not None:
            nn.init.normal_(self.weight, mean=0.0, std=self.init_std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)
        self.reset_adapters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = F.linear(F.linear(self._drop(x), self.lora_a), self.lora_b) * self.scale
        return F.linear(x, self.weight, self.bias) + update

    def tensor_parallel_placements(self, style: str) -> dict[str, Placement]:
        """The adapters' placements over `tp` when the base layer is `style`-parallel (`"colwise"`: weight
        `Shard(0)`, or `"rowwise"`: weight `Shard(1)`), as Megatron-Core/NeMo shard LoRA: a column-parallel base
        gets `lora_a` replicated and `lora_b` split on the output rows; a row-parallel base gets `lora_a` split on
        the input columns and `lora_b` replicated (its partial sums are reduced with the base layer's output)."""
        if style == "colwise":
            return {"lora_a": Replicate(), "lora_b": Shard(0)}
        if style == "rowwise":
            return {"lora_a": Shard(1), "lora_b": Replicate()}
        raise ValueError(f"LoRALinear.tensor_parallel_placements(style={style!r}): use 'colwise' or 'rowwise'")

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.dropout, self.training) if self.dropout else x

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        return merge_weight(self.weight, self.lora_a, self.lora_b, self.scale)


def merge_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """`weight + scale * B A`, computed in fp32 and returned in `weight`'s dtype."""
    return (weight.float() + scale * (lora_b.float() @ lora_a.float())).to(weight.dtype)


@dataclass
class LoRA:
    """Which linear layers get adapters and their shape.

    `target_modules`: our layer names (`q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`, `up_proj`,
    `down_proj`) or Megatron-Core's (`linear_qkv`, `linear_proj`, `linear_fc1`, `linear_fc2`). `dim`: the rank;
    `alpha`: the update is scaled by `alpha / dim`. `base_checkpoint`: the checkpoint whose weights the adapters
    apply to (set by `finetune` from its `RestoreConfig`), recorded in the adapter checkpoints.
    """

    target_modules: list[str] = field(default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    dim: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    base_checkpoint: str | None = None

    def __post_init__(self) -> None:
        if self.dim < 1:
            raise ValueError(f"LoRA(dim={self.dim}): the adapter rank must be 1 or more")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA(dropout={self.dropout}): use a probability in [0, 1)")

    @property
    def layer_names(self) -> set[str]:
        """Our names of the targeted linear layers (Megatron-Core's names expanded)."""
        names = set()
        for target in self.target_modules:
            names.update(MEGATRON_TARGETS.get(target, (target,)))
        return names

    def apply(self, module: nn.Module) -> nn.Module:
        """Freeze `module` and put adapters on its targeted linear layers (in place); return it.

        Raises, before changing anything, if a target names no linear layer of `module`.
        """
        linears = {
            name: child
            for name, child in module.named_modules()
            if isinstance(child, nn.Linear) and not isinstance(child, LoRALinear)
        }
        short_names = {name.rsplit(".", 1)[-1] for name in linears}
        unmatched = [t for t in self.target_modules if not set(MEGATRON_TARGETS.get(t, (t,))) & short_names]
        if unmatched:
            raise ValueError(
                f"LoRA(target_modules={self.target_modules}): {unmatched} match no linear layer; the model's are "
                f"{sorted(short_names)} (or Megatron-Core's names {sorted(MEGATRON_TARGETS)})"
            )
        module.requires_grad_(False)
        targets = self.layer_names
        for name, child in linears.items():
            parent_name, _, short = name.rpartition(".")
            if short in targets:
                parent = module.get_submodule(parent_name)
                setattr(parent, short, LoRALinear(child, self.dim, self.alpha, self.dropout))
        return module

    @staticmethod
    def is_adapter_key(key: str) -> bool:
        """Whether a state-dict key is an adapter's (saved in adapter checkpoints) rather than the base's."""
        return key.rsplit(".", 1)[-1] in ADAPTER_PARAMS
