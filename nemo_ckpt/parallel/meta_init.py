"""Materialize a model built on the `meta` device, module by module, with each module's own `reset_parameters`."""

import torch
from torch import nn


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of `module` (with its submodules) is still on `meta`."""
    return any(tensor.is_meta for tensor in [*module.parameters(), *module.buffers()])


@torch.no_grad()
def materialize(module: nn.Module, device: torch.device) -> None:
    """Allocate every submodule still on `meta` on `device` and initialize it with its `reset_parameters`.

    Submodules are visited in module order, so a model whose own `reset_parameters` initializes its
    submodules in that order gets the same values as one built eagerly.
    """
    for submodule in module.modules():
        own = [*submodule.parameters(recurse=False), *submodule.buffers(recurse=False)]
        if not any(tensor.is_meta for tensor in own):
            continue
        if not hasattr(submodule, "reset_parameters"):
            raise TypeError(
                f"{type(submodule).__name__} has parameters on the meta device but no `reset_parameters()`; "
                "give it one, or build the model without init_model_with_meta_device"
            )
        submodule.to_empty(device=device, recurse=False)
        submodule.reset_parameters()
