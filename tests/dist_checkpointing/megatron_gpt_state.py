"""A Megatron-Core GPT checkpoint as megatron-core writes it (weights + Adam state of its distributed optimizer),
saved or loaded by megatron-core under torchrun (with one megatron-core version on the path):

    python -m torch.distributed.run --nproc-per-node N tests/dist_checkpointing/megatron_gpt_state.py \
        {megatron,ours} {save,load} CKPT {flat,model_space}

or by us, also with `run_distributed(ours, N, ACTION, CKPT, FORMAT)`.

The layout is megatron-core's: layers stacked under `decoder.layers.*` (prepended axis), TP-sharded linear layers
(column-parallel `linear_qkv`, `linear_fc1`, vocab-parallel embedding and output; row-parallel `linear_proj`,
`linear_fc2`), replica ids (pp, tp, dp), and the distributed optimizer's state under `optimizer.state.<name>.<key>`:
`flat` is the `fully_sharded_model_space` format of megatron-core <= 0.18 (each dp rank holds a contiguous range
of the flattened gradient buffer: `flattened_range` slices of its TP shards); `model_space` is the
`fully_reshardable` format (state shaped and sharded like the weights), the one megatron-core 0.19 writes and the
one our checkpoints use.
World sizes: 1 (tp1 dp1), 2 (tp1 dp2), 4 (tp2 dp2). Loading checks every tensor against the expected values.
"""

import os
import sys
import zlib

import torch
import torch.distributed as dist

from tests.helpers.megatron import import_megatron_on_cpu

LAYERS, HIDDEN, FFN, VOCAB = 2, 8, 12, 16
# key -> (shape of one layer's tensor, tensor-parallel axis or None, stacked over layers)
PARAMS = {
    "embedding.word_embeddings.weight": ((VOCAB, HIDDEN), 0, False),
    "decoder.layers.self_attention.linear_qkv.layer_norm_weight": ((HIDDEN,), None, True),
    "decoder.layers.self_attention.linear_qkv.weight": ((3 * HIDDEN, HIDDEN), 0, True),
    "decoder.layers.self_attention.linear_proj.weight": ((HIDDEN, HIDDEN), 1, True),
    "decoder.layers.mlp.linear_fc1.layer_norm_weight": ((HIDDEN,), None, True),
    "decoder.layers.mlp.linear_fc1.weight": ((2 * FFN, HIDDEN), 0, True),
    "decoder.layers.mlp.linear_fc2.weight": ((HIDDEN, FFN), 1, True),
    "decoder.final_layernorm.weight": ((HIDDEN,), None, False),
    "output_layer.weight": ((VOCAB, HIDDEN), 0, False),
}
OPTIMIZER_STATES = ("fp32_param", "exp_avg", "exp_avg_sq")
PARAM_GROUPS = [{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "params": list(range(16))}]
ITERATION = 42


def global_value(key: str) -> torch.Tensor:
    """The whole tensor of `key` (layers stacked in front), the same in every process."""
    shape, _, stacked = PARAMS[key.split(".", 3)[-1] if key.startswith("optimizer.") else key]
    generator = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return torch.randn(((LAYERS,) if stacked else ()) + shape, generator=generator)


def layout(world_size: int) -> tuple[int, int]:
    """(tp, dp) of a world size."""
    return {1: (1, 1), 2: (1, 2), 4: (2, 2)}[world_size]


def local_tensors(rank: int, world_size: int) -> list[tuple[str, int | None, tuple[int, ...], torch.Tensor]]:
    """This rank's model tensors in megatron-core's order: (key, layer, local shape, local values)."""
    tp, _ = layout(world_size)
    tp_rank = rank % tp
    tensors = []
    for key, (_, axis, stacked) in PARAMS.items():
        whole = global_value(key)
        for layer in range(LAYERS) if stacked else [None]:
            value = whole[layer] if stacked else whole
            if axis is not None:
                value = value.chunk(tp, dim=axis)[tp_rank]
            tensors.append((key, layer, tuple(value.shape), value.contiguous()))
    return tensors


def dp_ranges(rank: int, world_size: int) -> list[slice | None]:
    """The distributed optimizer's share of each local tensor on this dp rank (None: nothing of it): the
    concatenated tensors are padded to a multiple of dp and split into dp contiguous ranges."""
    tp, dp = layout(world_size)
    dp_rank = rank // tp
    sizes = [value.numel() for *_, value in local_tensors(rank, world_size)]
    per_rank = -(-sum(sizes) // dp)
    start, end = dp_rank * per_rank, (dp_rank + 1) * per_rank
    ranges, offset = [], 0
    for size in sizes:
        low, high = max(start, offset), min(end, offset + size)
        ranges.append(slice(low - offset, high - offset) if low < high else None)
        offset += size
    return ranges


def sharded_state(lib, rank: int, world_size: int, flat: bool, template: bool) -> dict:
    """The sharded state dict of megatron-core's GPT + distributed optimizer, with values or empty (a template)."""
    tp, _ = layout(world_size)
    tp_rank, dp_rank = rank % tp, rank // tp

    def sharded(key, layer, value, **kwargs):
        axis = PARAMS[key.split(".", 3)[-1] if key.startswith("optimizer.") else key][1]
        offsets = [(0, layer, LAYERS)] if layer is not None else []
        if axis is not None:
            offsets.append((axis + len(offsets), tp_rank, tp))
        replica = (0, 0 if axis is not None else tp_rank, kwargs.pop("dp_replica", dp_rank))
        return offsets, {"replica_id": replica, "prepend_axis_num": int(layer is not None)}

    model, optimizer_state = {}, {}
    for index, ((key, layer, shape, value), flat_range) in enumerate(
        zip(local_tensors(rank, world_size), dp_ranges(rank, world_size))
    ):
        name = key if layer is None else f"{key}.{layer}"
        offsets, kwargs = sharded(key, layer, value)
        model[name] = lib.ShardedTensor.from_rank_offsets(
            key, torch.empty_like(value) if template else value.clone(), *offsets, **kwargs
        )
        states = {}
        for state in OPTIMIZER_STATES:
            state_key = f"optimizer.state.{state}.{key}"
            whole = global_value(state_key)
            local = whole[layer] if layer is not None else whole
            if PARAMS[key][1] is not None:
                local = local.chunk(tp, dim=PARAMS[key][1])[tp_rank]
            offsets, kwargs = sharded(state_key, layer, local, dp_replica=0)
            if not flat:
                kwargs["replica_id"] = kwargs["replica_id"][:2] + (dp_rank,)
                states[state] = lib.ShardedTensor.from_rank_offsets(
                    state_key, torch.empty_like(local) if template else local.contiguous().clone(), *offsets, **kwargs
                )
            elif flat_range is not None:
                data = local.flatten()[flat_range]
                states[state] = lib.ShardedTensor.from_rank_offsets_flat(
                    state_key,
                    torch.empty_like(data) if template else data.clone(),
                    shape,
                    *offsets,
                    flattened_range=flat_range,
                    **kwargs,
                )
        if states:
            optimizer_state[index] = states
    return {
        "model": model,
        "optimizer": {"state": optimizer_state, "param_groups": PARAM_GROUPS},
        "iteration": ITERATION,
        "checkpoint_version": 3.0,
    }


def expected_local(sharded_tensor) -> torch.Tensor:
    """What a loaded ShardedTensor must hold, from the global values."""
    value, prepended = global_value(sharded_tensor.key), sharded_tensor.prepend_axis_num
    for axis, offset in enumerate(sharded_tensor.global_offset):
        value = value.narrow(axis, offset, 1 if axis < prepended else sharded_tensor.local_shape[axis - prepended])
    value = value.reshape(sharded_tensor.local_shape)
    if sharded_tensor.flattened_range is not None:
        value = value.flatten()[sharded_tensor.flattened_range]
    return value


def save_or_load(library: str, action: str, checkpoint: str, optimizer_format: str) -> int:
    """Save or load the state with `library` on this rank; a load checks every tensor and returns how many."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if library == "megatron":
        lib = import_megatron_on_cpu("megatron.core.dist_checkpointing")
    else:
        from nemo_ckpt import dist_checkpointing as lib
    flat = optimizer_format == "flat"
    template = sharded_state(lib, rank, world_size, flat, template=action == "load")
    checked = 0
    if action == "save":
        os.makedirs(checkpoint, exist_ok=True)  # megatron-core saves into an existing directory
        lib.save(template, checkpoint)
    else:
        loaded = lib.load(template, checkpoint)
        assert loaded["iteration"] == ITERATION and loaded["checkpoint_version"] == 3.0
        assert loaded["optimizer"]["param_groups"][0]["lr"] == PARAM_GROUPS[0]["lr"]
        for name, value in loaded["model"].items():
            assert torch.equal(value, expected_local(template["model"][name])), name
            checked += 1
        for index, states in loaded["optimizer"]["state"].items():
            for state, value in states.items():
                assert torch.equal(value, expected_local(template["optimizer"]["state"][index][state])), (index, state)
                checked += 1
        assert checked == len(template["model"]) + sum(map(len, template["optimizer"]["state"].values()))
    dist.barrier()
    return checked


def ours(rank: int, world_size: int, action: str, checkpoint: str, optimizer_format: str) -> int:
    """`save_or_load` with our library, on a rank of `run_distributed`."""
    return save_or_load("ours", action, checkpoint, optimizer_format)


def main(library: str, action: str, checkpoint: str, optimizer_format: str) -> None:
    dist.init_process_group("gloo")
    checked = save_or_load(library, action, checkpoint, optimizer_format)
    if action == "load":
        print(f"rank {dist.get_rank()}: {checked} tensors equal", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:5])
