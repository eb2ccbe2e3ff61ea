"""The MoE layer on one process against a reference written in plain loops over tokens and experts."""

import math

import pytest
import torch
import torch.nn.functional as F

from nemo_ckpt.models.gpt.model import GPT, MLP, gpt_config
from nemo_ckpt.models.gpt.moe import MoELayer, active_mlp_weights, moe_layer_pattern, moe_metrics

NUM_EXPERTS = 4


def reference_moe(layer: MoELayer, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Output [tokens, hidden] and aux + z loss, token by token, expert by expert (no batched routing)."""
    config = layer.config
    topk, experts = config.moe_router_topk, config.num_moe_experts
    logits = [layer.router.weight @ token for token in tokens]
    routes = []  # per token: [(expert, prob)]
    for row in logits:
        order = sorted(range(experts), key=lambda expert: -row[expert].item())[:topk]
        if config.moe_router_score_function == "softmax":
            exps = [torch.exp(row[expert] - row[order[0]]) for expert in order]
            probs = [value / sum(exps) for value in exps]
        else:
            scores = [torch.sigmoid(row[expert]) for expert in order]
            probs = [score / sum(scores) for score in scores] if topk > 1 else scores
        routes.append(list(zip(order, probs)))
    unlimited_counts = [sum(expert in dict(route) for route in routes) for expert in range(experts)]
    if config.moe_expert_capacity_factor is not None:
        capacity = math.ceil(len(tokens) * topk / experts * config.moe_expert_capacity_factor)
        kept = []
        for expert in range(experts):
            pairs = [(t, p) for t, route in enumerate(routes) for e, p in route if e == expert]
            if config.moe_token_drop_policy == "probs":
                pairs = sorted(pairs, key=lambda pair: -pair[1].item())
            kept += [(t, expert) for t, _ in pairs[:capacity]]
        routes = [[(e, p) for e, p in route if (t, e) in kept] for t, route in enumerate(routes)]
    outputs = []
    for t, token in enumerate(tokens):
        out = torch.zeros_like(token)
        for expert, prob in routes[t]:
            out = out + prob * layer.experts[str(expert)](token[None])[0]
        if layer.shared_experts is not None:
            out = out + layer.shared_experts(token[None])[0]
        outputs.append(out)
    aux = torch.zeros((), dtype=tokens.dtype)
    if config.moe_aux_loss_coeff:
        if config.moe_router_score_function == "softmax":
            scores = [torch.softmax(row, dim=0) for row in logits]
        else:
            scores = [torch.sigmoid(row) / torch.sigmoid(row).sum() for row in logits]
        for expert in range(experts):
            aux = aux + sum(score[expert] for score in scores) * unlimited_counts[expert]
        aux = aux * experts * config.moe_aux_loss_coeff / (len(tokens) ** 2 * topk)
    if config.moe_z_loss_coeff:
        z = sum(torch.logsumexp(row, dim=0) ** 2 for row in logits) / len(tokens)
        aux = aux + z * config.moe_z_loss_coeff
    return torch.stack(outputs), aux


CASES = {
    "dropless": {},
    "capacity_probs": {"moe_expert_capacity_factor": 1.0},
    "capacity_position": {"moe_expert_capacity_factor": 0.75, "moe_token_drop_policy": "position"},
    "sigmoid_shared": {"moe_router_score_function": "sigmoid", "moe_shared_expert_intermediate_size": 24},
    "top1": {"moe_router_topk": 1, "moe_expert_capacity_factor": 1.5},
}


@pytest.mark.parametrize("case", CASES)
def test_routed_mlp_equals_plain_loop_reference(case):
    torch.manual_seed(0)
    config = gpt_config(
        "tiny",
        hidden_size=16,
        ffn_hidden_size=24,
        num_attention_heads=2,
        num_query_groups=2,
        num_moe_experts=NUM_EXPERTS,
        moe_aux_loss_coeff=0.01,
        moe_z_loss_coeff=0.001,
        **CASES[case],
    )
    # float64, so that only a difference in routing or combining (not summation order) shows
    layer = MoELayer(config, lambda size: MLP(config, size)).double()
    for param in layer.parameters():  # larger weights than the init: routing and outputs far from 0
        param.data.normal_(0, 0.5)
    hidden = torch.randn(2, 10, 16, dtype=torch.float64, requires_grad=True)
    grad_output = torch.randn(2, 10, 16, dtype=torch.float64)

    output = layer(hidden)
    (output * grad_output).sum().backward()
    grads = {name: param.grad.clone() for name, param in layer.named_parameters()}
    input_grad = hidden.grad.clone()

    layer.zero_grad()
    hidden.grad = None
    expected, aux = reference_moe(layer, hidden.reshape(-1, 16))
    ((expected * grad_output.reshape(-1, 16)).sum() + aux).backward()

    torch.testing.assert_close(output.reshape(-1, 16), expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(input_grad, hidden.grad, atol=1e-6, rtol=1e-6)
    for name, param in layer.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, atol=1e-6, rtol=1e-6, msg=name)
    if "capacity" in case:  # the case really drops tokens
        assert layer.last_metrics["tokens_per_expert"].sum() < hidden.shape[0] * hidden.shape[1] * 2


def test_moe_layer_freq_mixes_dense_and_moe_layers():
    config = gpt_config("tiny", num_layers=4, num_moe_experts=4, moe_layer_freq=2)
    assert moe_layer_pattern(config) == [True, False, True, False]
    model = GPT(gpt_config("tiny", num_moe_experts=4, moe_layer_freq=[0, 1]))
    assert isinstance(model.layers[0].mlp, MLP) and isinstance(model.layers[1].mlp, MoELayer)
    assert sum(param.numel() for param in model.parameters()) == model.config.num_parameters()
    assert "layers.1.mlp.experts.3.down_proj.weight" in model.state_dict()


def test_metrics_of_the_last_forward():
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", num_moe_experts=4, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001))
    tokens = torch.randint(0, 256, (2, 32))
    F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    metrics = moe_metrics(model)
    # each of 64 tokens to 2 experts, in each of 2 layers
    counts = torch.stack([layer.mlp.last_metrics["tokens_per_expert"] for layer in model.layers])
    assert counts.sum(dim=1).tolist() == [128.0, 128.0]
    assert metrics["tokens_per_expert_min"] == counts.min() and metrics["tokens_per_expert_max"] == counts.max()
    assert metrics["load_balancing_loss"] >= 0.01  # >= coeff, equal when perfectly balanced
    assert metrics["z_loss"] > 0
    assert model.layers[0].mlp.router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_moe_experts": 4, "moe_router_topk": 5}, "moe_router_topk=5 must be between 1 and num_moe_experts=4"),
        ({"num_moe_experts": 4, "moe_expert_capacity_factor": 0.0}, "moe_expert_capacity_factor=0.0 must be > 0"),
        ({"num_moe_experts": 4, "moe_router_score_function": "relu"}, "moe_router_score_function='relu'"),
        ({"num_moe_experts": 4, "moe_layer_freq": [1]}, "one 0 \\(dense\\) or 1 \\(MoE\\) per layer"),
        ({"num_moe_experts": 4, "moe_token_drop_policy": "random"}, "moe_token_drop_policy='random'"),
    ],
)
def test_bad_moe_config_names_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        gpt_config("tiny", **overrides)


def test_flops_count_the_router_and_top_k_experts_a_token_goes_through():
    config = gpt_config("tiny", num_moe_experts=4, moe_ffn_hidden_size=32, moe_layer_freq=[1, 0])
    assert active_mlp_weights(config) == 3 * 64 * 172 + (3 * 64 * 32 * 2 + 64 * 4)
