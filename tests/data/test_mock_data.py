import torch

from nemo_ckpt.data.mock import ArithmeticSequences


def test_samples_are_deterministic_and_shifted():
    dataset = ArithmeticSequences(num_samples=8, seq_length=16, vocab_size=256, seed=3)
    first, again = dataset[5], ArithmeticSequences(8, 16, 256, 3)[5]
    assert torch.equal(first["tokens"], again["tokens"])
    assert torch.equal(first["tokens"][1:], first["labels"][:-1])
    assert not torch.equal(dataset[4]["tokens"], first["tokens"])
