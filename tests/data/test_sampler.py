"""Megatron's pretraining sampler: data-parallel ranks partition each global batch; resuming skips what was consumed."""

from nemo_ckpt.data.sampler import PretrainingSampler


def test_ranks_partition_each_global_batch():
    samplers = [
        PretrainingSampler(24, 0, micro_batch_size=2, data_parallel_rank=r, data_parallel_size=3) for r in range(3)
    ]
    batches = [list(s) for s in samplers]
    assert [len(b) for b in batches] == [4, 4, 4]
    seen = sorted(i for rank_batches in batches for batch in rank_batches for i in batch)
    assert seen == list(range(24))


def test_resumed_sampler_continues_after_consumed_samples():
    full = list(PretrainingSampler(16, 0, micro_batch_size=2, data_parallel_rank=1, data_parallel_size=2))
    resumed = list(PretrainingSampler(16, 8, micro_batch_size=2, data_parallel_rank=1, data_parallel_size=2))
    assert resumed == full[2:]
