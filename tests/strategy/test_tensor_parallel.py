"""`MegatronStrategy(tensor_model_parallel_size, sequence_parallel)` through Lightning: a run resumes across TP
sizes and data-parallel layouts with identical weights and optimizer state, and follows single-process training.

One run is passed along a chain of layouts, 2 steps each: TP=2 + SP (2 ranks) -> TP=1 / FSDP DP=2 -> TP=2 with
FSDP over dp=1 -> dp2 x tp2 FSDP + SP (4 ranks) -> TP=2 + SP with replicas over dp=2, gradients reduced during
backward (4 ranks). The 4-rank phases save and load in parallel within their data-parallel groups.
"""

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch.distributed as dist

from nemo_ckpt.parallel.ddp_config import DistributedDataParallelConfig
from nemo_ckpt.strategy import MegatronStrategy
from nemo_ckpt.strategy.comm_overlap import MegatronCommOverlapCallback
from tests.helpers.distributed import run_distributed
from tests.helpers.trainer import RecordLoss, SaveAtStart, StopAndSave, assert_same_checkpoint, fit_tiny_gpt

GLOBAL_BATCH_SIZE = 4
MAX_STEPS = 10
MODEL = {"num_query_groups": 2}
PARALLEL_WITHIN_DP = {
    "ckpt_parallel_save": True,
    "ckpt_parallel_save_within_dp": True,
    "ckpt_parallel_load": True,
    "ckpt_parallel_save_optim": True,
}
CHAIN = [
    (2, {"tensor_model_parallel_size": 2, "sequence_parallel": True, "ddp": "megatron"}),
    (2, {"ddp": DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads_params")}),
    (
        2,
        {
            "tensor_model_parallel_size": 2,
            "ddp": DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads"),
        },
    ),
    (
        4,
        {
            "tensor_model_parallel_size": 2,
            "sequence_parallel": True,
            "ddp": DistributedDataParallelConfig(
                data_parallel_sharding_strategy="optim_grads_params", overlap_param_gather=True
            ),
            **PARALLEL_WITHIN_DP,
        },
    ),
    (
        4,
        {
            "tensor_model_parallel_size": 2,
            "sequence_parallel": True,
            "ddp": DistributedDataParallelConfig(overlap_grad_reduce=True, check_for_nan_in_grad=True),
            **PARALLEL_WITHIN_DP,
        },
    ),
]
SAVE_GROUP = "ranks sharing the parallel save"
Q_PROJ = "module.layers.0.self_attention.q_proj.weight"
NORM = "module.layers.0.input_layernorm.weight"


def fit(
    world_size: int,
    max_steps: int,
    strategy_kwargs: dict[str, Any],
    callbacks: list[pl.Callback],
    ckpt_path: Path | None = None,
) -> pl.Trainer:
    return fit_tiny_gpt(
        world_size, MegatronStrategy(**strategy_kwargs), max_steps, callbacks, ckpt_path, model_overrides=MODEL
    )


def describe(sh_ten: Any) -> tuple:
    return sh_ten.local_shape, sh_ten.global_offset, sh_ten.axis_fragmentations, sh_ten.replica_id


def train_phase(rank: int, world_size: int, phase: int, directory: Path) -> tuple[list[float], dict[str, tuple]]:
    _, strategy_kwargs = CHAIN[phase]
    stop_at = 2 * (phase + 1)
    resume_from = directory / f"step{stop_at - 2}" if phase else None
    recorder = RecordLoss()
    callbacks = [recorder, StopAndSave(stop_at, directory / f"step{stop_at}")]
    if resume_from is not None:
        callbacks.append(SaveAtStart(directory / f"loaded{stop_at - 2}"))
    trainer = fit(world_size, MAX_STEPS, strategy_kwargs, callbacks, ckpt_path=resume_from)
    model_shards = trainer.strategy.sharded_state_dict()["state_dict"]
    save_group = getattr(trainer.strategy.checkpoint_io._save_strategy, "parallelization_group", None)
    return recorder.losses, {
        **{key: describe(model_shards[key]) for key in (Q_PROJ, NORM)},
        SAVE_GROUP: None if save_group is None else dist.get_process_group_ranks(save_group),
    }


def uninterrupted(rank: int, world_size: int) -> list[float]:
    recorder = RecordLoss()
    fit(1, MAX_STEPS, {"ddp": "megatron"}, [recorder])
    return recorder.losses


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> tuple[Path, list[float], list[list[dict[str, tuple]]]]:
    directory = tmp_path_factory.mktemp("tp_chain")
    losses, shards = [], []
    for phase, (world_size, _) in enumerate(CHAIN):
        per_rank = run_distributed(train_phase, world_size, phase, directory)
        assert len(per_rank[0][0]) == 2, f"phase {phase} trains 2 more steps"
        assert all(rank_losses == per_rank[0][0] for rank_losses, _ in per_rank), "every rank logs the same loss"
        losses += per_rank[0][0]
        shards.append([rank_shards for _, rank_shards in per_rank])
    return directory, losses, shards


@pytest.mark.parametrize("phase", range(1, len(CHAIN)))
def test_resume_across_tensor_parallel_sizes_loads_identical_state(chain, phase):
    directory, _, _ = chain
    assert_same_checkpoint(directory / f"step{2 * phase}", directory / f"loaded{2 * phase}")


def test_training_across_layouts_matches_single_process(chain):
    _, losses, _ = chain
    [reference] = run_distributed(uninterrupted, 1)
    assert reference[-1] < reference[0] - 0.3, "the model learns"
    assert losses == pytest.approx(reference, rel=1e-5, abs=1e-5)


def test_sharded_state_dict_expresses_tensor_parallel_shards_and_data_parallel_replicas(chain):
    _, _, shards = chain
    # TP=2 + SP on 2 ranks: q_proj [64, 64] split in rows by tp; the norm replicated over tp, saved by tp rank 0
    assert [rank[Q_PROJ] for rank in shards[0]] == [((32, 64), (0, 0), (2, 1), (0,)), ((32, 64), (32, 0), (2, 1), (0,))]
    assert [rank[NORM][3] for rank in shards[0]] == [(0, 0), (0, 1)]
    # dp2 x tp2 with FSDP: rows split by tp, then by dp; nothing replicated
    assert [rank[Q_PROJ][:3] for rank in shards[3]] == [
        ((16, 64), (0, 0), (4, 1)),
        ((16, 64), (32, 0), (4, 1)),
        ((16, 64), (16, 0), (4, 1)),
        ((16, 64), (48, 0), (4, 1)),
    ]
    # TP=2 with dp=2 replicas (ranks 0, 1 are dp rank 0): the dp rank is the outer replica id
    assert [rank[Q_PROJ][1:] for rank in shards[4]] == [
        ((0, 0), (2, 1), (0,)),
        ((32, 0), (2, 1), (0,)),
        ((0, 0), (2, 1), (1,)),
        ((32, 0), (2, 1), (1,)),
    ]
    assert [rank[NORM][3] for rank in shards[4]] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_parallel_save_within_dp_spreads_over_the_data_parallel_group(chain):
    _, _, shards = chain
    assert [rank[SAVE_GROUP] for rank in shards[0]] == [None, None], "no parallel save: plain strategy"
    for phase in (3, 4):  # (dp, tp) mesh, tp inner: tp rank 0 = ranks 0, 2
        assert [rank[SAVE_GROUP] for rank in shards[phase]] == [[0, 2], [1, 3], [0, 2], [1, 3]]


def overlap_on_cpu(rank: int, world_size: int) -> str:
    callback = MegatronCommOverlapCallback(tp_comm_overlap=True)
    with pytest.raises(ValueError) as error:
        fit(world_size, 1, {"tensor_model_parallel_size": 2, "sequence_parallel": True}, [callback])
    return str(error.value)


def test_tp_comm_overlap_is_rejected_on_cpu_at_setup():
    messages = run_distributed(overlap_on_cpu, 2)
    assert messages[0] == messages[1]
    assert messages[0].startswith("tp_comm_overlap=True: tensor-parallel communication overlap needs GPU-only kernels")
    assert "this run is on 'cpu'" in messages[0]


def test_layouts_the_strategy_cannot_combine_are_rejected():
    with pytest.raises(ValueError, match=r"does not support data_parallel_sharding_strategy='optim' \(ZeRO-1\)"):
        MegatronStrategy(
            tensor_model_parallel_size=2, ddp=DistributedDataParallelConfig(data_parallel_sharding_strategy="optim")
        )
    with pytest.raises(ValueError, match="set tensor_model_parallel_size > 1 or sequence_parallel=False"):
        MegatronStrategy(sequence_parallel=True)
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size=0\): use 1 or more"):
        MegatronStrategy(tensor_model_parallel_size=0)
