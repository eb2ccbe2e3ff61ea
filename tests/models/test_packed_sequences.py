"""Packed sequences in the model: a packed row (restarted `position_ids`, block-diagonal causal mask from
`segment_ids`) gives each sample the logits and gradients it gets alone; `GPTModel` passes both from the batch;
pipeline and context parallelism refuse them."""

import pytest
import torch
import torch.nn.functional as F

from nemo_ckpt.data.sft import PackedSequenceSpecs, SFTDataset
from nemo_ckpt.data.tokenizer import ByteLevelTokenizer
from nemo_ckpt.models import GPTModel, gpt_config
from nemo_ckpt.models.gpt.model import GPT, Attention, packed_attention_mask
from nemo_ckpt.parallel.context_parallel import ContextParallel

ROW = 24
LENGTHS = [(5, 9, 3), (11, 7)]  # samples per row; the rest of each row is padding (its own segment)
CONFIGS = {
    "tiny": {},
    "grouped_queries": {"num_query_groups": 2},
    "recompute": {"recompute_granularity": "full"},
    "tied_moe": {"num_moe_experts": 2, "moe_ffn_hidden_size": 32, "share_embeddings_and_output_weights": True},
}


def packed_rows(samples: list[list[torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens, position_ids and segment_ids [len(samples), ROW] of rows holding `samples`, padded with token 0."""
    tokens, positions, segments = [], [], []
    for row in samples:
        padding = torch.zeros(ROW - sum(len(sample) for sample in row), dtype=torch.long)
        pieces = [*row, padding]  # the padding is one more segment, with positions from 0 too
        tokens.append(torch.cat(pieces))
        positions.append(torch.cat([torch.arange(len(piece)) for piece in pieces]))
        segments.append(torch.cat([torch.full((len(piece),), index) for index, piece in enumerate(pieces)]))
    return torch.stack(tokens), torch.stack(positions), torch.stack(segments)


def make_samples(vocab_size: int) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [[torch.randint(vocab_size, (length,), generator=generator) for length in row] for row in LENGTHS]


def test_mask_is_causal_within_each_segment_only():
    mask = packed_attention_mask(torch.tensor([[0, 0, 1, 1, 1, 2]]))
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [0, 0, 1, 0, 0, 0],
            [0, 0, 1, 1, 0, 0],
            [0, 0, 1, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert mask.shape == (1, 1, 6, 6) and torch.equal(mask[0, 0], expected)


@pytest.mark.parametrize("overrides", CONFIGS.values(), ids=CONFIGS.keys())
def test_packed_row_logits_equal_each_sample_alone(overrides):
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", **overrides))
    samples = make_samples(model.config.vocab_size)
    tokens, position_ids, segment_ids = packed_rows(samples)
    with torch.no_grad():
        logits = model(tokens, position_ids, segment_ids)
        unmasked = model(tokens, position_ids)
        for row, row_samples in enumerate(samples):
            start = 0
            for sample in row_samples:
                alone = model(sample.unsqueeze(0))[0]
                packed = logits[row, start : start + len(sample)]
                torch.testing.assert_close(packed, alone, rtol=0, atol=1e-6)
                if start > 0:  # without the mask, a later sample sees the earlier ones: different logits
                    assert (unmasked[row, start : start + len(sample)] - alone).abs().max() > 1e-3
                start += len(sample)


def test_one_segment_is_plain_causal_attention():
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny"))
    tokens = torch.randint(model.config.vocab_size, (2, ROW))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, None, torch.zeros_like(tokens)), model(tokens), rtol=0, atol=1e-6)


def masked_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="sum")


@pytest.mark.parametrize("overrides", CONFIGS.values(), ids=CONFIGS.keys())
def test_packed_row_gradients_equal_the_sum_over_samples_alone(overrides):
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", **overrides))
    samples = make_samples(model.config.vocab_size)
    tokens, position_ids, segment_ids = packed_rows(samples)
    labels = torch.roll(tokens, -1, dims=1)  # any fixed targets; only the samples' own positions count
    trained = segment_ids < torch.tensor([[len(row)] for row in samples])

    logits = model(tokens, position_ids, segment_ids)
    masked_loss_sum(logits[trained], labels[trained]).backward()
    packed = {name: param.grad.clone() for name, param in model.named_parameters()}

    model.zero_grad()
    for row, row_samples in enumerate(samples):
        start = 0
        for sample in row_samples:
            alone = model(sample.unsqueeze(0))[0]
            masked_loss_sum(alone, labels[row, start : start + len(sample)]).backward()
            start += len(sample)
    for name, param in model.named_parameters():
        torch.testing.assert_close(packed[name], param.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert all(grad.abs().sum() > 0 for name, grad in packed.items() if "router" not in name)


def test_gpt_model_trains_packed_batches_on_answers_only():
    records = [{"input": f"question {i}", "output": f"answer {i}"} for i in range(6)]  # 19 positions each
    options = {"prompt_template": "{input}\n", "message_template": "{role}: {content}\n", "seed": 0}
    specs = PackedSequenceSpecs(packed_sequence_size=64)
    data = SFTDataset(records, ByteLevelTokenizer(), 48, None, **options, packed_sequence_specs=specs)
    batch = {key: torch.stack([data[0][key], data[1][key]]) for key in data[0]}
    assert batch["segment_ids"][:, -1].tolist() == [3, 3]  # 3 samples per row, then padding
    torch.manual_seed(0)
    model = GPTModel(gpt_config("tiny", vocab_size=260))
    model.configure_model()
    captured = {}

    def keep_logits(module, inputs, logits):
        logits.retain_grad()
        captured["logits"] = logits

    hook = model.module.output_layer.register_forward_hook(keep_logits)
    loss = model.loss(batch)
    loss.backward()
    hook.remove()
    per_position = captured["logits"].grad.abs().sum(-1)
    assert torch.all(per_position[batch["loss_mask"] == 0] == 0) and torch.all(
        per_position[batch["loss_mask"] == 1] > 0
    )

    # the loss of each sample run alone (its own slice of the row, positions from 0): answer-token losses / count
    total, count = torch.zeros(()), batch["loss_mask"].sum()
    with torch.no_grad():
        for row in range(2):
            for segment in range(3):
                columns = batch["segment_ids"][row] == segment
                logits = model(batch["tokens"][row, columns].unsqueeze(0))[0]
                losses = F.cross_entropy(logits, batch["labels"][row, columns], reduction="none")
                total += (losses * batch["loss_mask"][row, columns]).sum()
    torch.testing.assert_close(loss.detach(), total / count, rtol=0, atol=1e-6)


def test_pipeline_and_context_parallelism_refuse_packed_batches():
    model = GPTModel(gpt_config("tiny"))
    model.configure_model()
    tokens = torch.zeros(1, 8, dtype=torch.long)
    batch = {"tokens": tokens, "labels": tokens, "segment_ids": tokens, "position_ids": tokens}
    with pytest.raises(ValueError, match="not supported with pipeline parallelism: use pipeline_model_parallel_size=1"):
        model.pipeline_inputs(batch)
    attention = next(module for module in model.module.modules() if isinstance(module, Attention))
    attention.context_parallel = ContextParallel.__new__(ContextParallel)  # set, as by parallelize_context
    with pytest.raises(ValueError, match="packed sequences .* not supported with context parallelism"):
        model.loss(batch)
