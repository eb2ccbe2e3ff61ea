"""`OptimizerConfig`: the optimizer it builds and how that optimizer updates parameters."""

import pytest
import torch

from nemo_ckpt.optim import OptimizerConfig


def test_adam_is_torchs_fused_adamw_and_updates_as_the_reference_adamw():
    torch.manual_seed(0)
    config = OptimizerConfig(lr=1e-2, weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.9, adam_eps=1e-6)
    params = [torch.nn.Parameter(torch.randn(300, 7)), torch.nn.Parameter(torch.randn(5))]
    initial = [p.detach().clone() for p in params]
    reference_params = [torch.nn.Parameter(p.clone()) for p in initial]
    optimizer = config.build_optimizer(iter(params))
    reference = torch.optim.AdamW(reference_params, lr=1e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)

    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["fused"] is True
    for _ in range(3):
        grads = [torch.randn_like(p) for p in params]
        for p, r, g in zip(params, reference_params, grads, strict=True):
            p.grad, r.grad = g.clone(), g.clone()
        optimizer.step()
        reference.step()
    for p, r, start in zip(params, reference_params, initial, strict=True):
        torch.testing.assert_close(p, r)
        assert not torch.equal(p, start)


def test_unknown_optimizer_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"OptimizerConfig.optimizer='lamb': use 'adam' or 'sgd'"):
        OptimizerConfig(optimizer="lamb")
