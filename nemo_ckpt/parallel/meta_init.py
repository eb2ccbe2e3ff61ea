"""Materialize a model built on the `meta` device, module by module, with each module's own `reset_parameters`."""

import copy

import torch
from torch import nn


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of `module` (with its submodules) is still on `meta`."""
    return any(tensor.is_meta for tensor in [*module.parameters(), *module.buffers()])


def _has_own_meta_tensors(module: nn.Module) -> bool:
    return any(tensor.is_meta for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)])


def default_generator(device: torch.device) -> torch.Generator:
    """The generator that initializes tensors on `device`."""
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


@torch.no_grad()
def record_init_rng_states(module: nn.Module, device: torch.device) -> torch.Tensor:
    """Give each submodule of `module` still on `meta` the generator state its initialization starts from when the
    whole `module` is materialized in module order, by running every initialization once on a scratch copy (one
    module at a time). `materialize` then initializes any of them from that state, so the part of a model kept
    after the rest is dropped (a pipeline stage) gets the values the whole model would. Returns the generator
    state after the whole model, where eager construction leaves it."""
    generator = default_generator(device)
    for submodule in module.modules():
        if _has_own_meta_tensors(submodule):
            submodule.init_rng_state = generator.get_state()
            scratch = copy.deepcopy(submodule)
            scratch.to_empty(device=device, recurse=False)
            scratch.reset_parameters()
    return generator.get_state()


@torch.no_grad()
def materialize(module: nn.Module, device: torch.device) -> None:
    """Allocate every submodule still on `meta` on `device` and initialize it with its `reset_parameters`.

    Submodules are visited in module order, so a model whose own `reset_parameters` initializes its
    submodules in that order gets the same values as one built eagerly. A submodule given a generator state by
    `record_init_rng_states` is initialized from it.
    """
    for submodule in module.modules():
        if not _has_own_meta_tensors(submodule):
            continue
        if not hasattr(submodule, "reset_parameters"):
            raise TypeError(
                f"{type(submodule).__name__} has parameters on the meta device but no `reset_parameters()`; "
                "give it one, or build the model without init_model_with_meta_device"
            )
        state = submodule.__dict__.pop("init_rng_state", None)
        if state is not None:
            default_generator(device).set_state(state)
        submodule.to_empty(device=device, recurse=False)
        submodule.reset_parameters()
