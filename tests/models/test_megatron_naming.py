"""Megatron-Core GPT naming <-> ours: bit-exact round trips and the documented fused layouts.

The fused tensors are checked against megatron-core's documented layout (the `linear_qkv` split of
`SelfAttention.get_query_key_value_tensors`, SwiGLU's `chunk(2)` of `linear_fc1`); with megatron-core importable,
`test_megatron_core_gpt.py` runs its GPTModel on our exported state. The checkpoint's tokenizer (`context/hf`) goes
with the weights."""

from types import SimpleNamespace

import pytest
import torch

from nemo_ckpt import dist_checkpointing
from nemo_ckpt.api import export_ckpt, import_ckpt
from nemo_ckpt.checkpoint.context import save_context
from nemo_ckpt.checkpoint.layout import hf_artifacts_dir, weights_dir
from nemo_ckpt.data.tokenizer import ByteLevelTokenizer
from nemo_ckpt.dist_checkpointing import ShardedTensor
from nemo_ckpt.models import GPT, GPTModel, gpt_config
from nemo_ckpt.models.gpt.convert.megatron import FC1, QKV, QKV_BIAS, from_megatron, to_megatron

CONFIG = gpt_config("tiny", num_attention_heads=4, num_query_groups=2, num_layers=3)


def our_state(config=CONFIG) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_()  # distinct values everywhere, norms included
    return {f"module.{key}": value for key, value in model.state_dict().items()}


def test_round_trip_is_bit_exact_and_layers_are_stacked():
    ours = our_state()
    megatron = to_megatron(ours.__getitem__, CONFIG)
    head_dim = CONFIG.head_dim
    assert megatron[QKV].shape == (3, (4 + 2 * 2) * head_dim, CONFIG.hidden_size)
    assert megatron[FC1].shape == (3, 2 * CONFIG.ffn_hidden_size, CONFIG.hidden_size)
    assert "output_layer.weight" in megatron and "decoder.layers.mlp.linear_fc1.layer_norm_weight" in megatron
    back = from_megatron(megatron, CONFIG)
    assert back.keys() == ours.keys()
    for key in ours:
        assert torch.equal(back[key], ours[key]), key


def test_qwen_options_round_trip_bit_exact():
    config = gpt_config("tiny", num_query_groups=2, add_qkv_bias=True, qk_layernorm=True, kv_channels=32)
    ours = our_state(config)
    megatron = to_megatron(ours.__getitem__, config)
    assert megatron[QKV_BIAS].shape == (2, (4 + 2 * 2) * 32)
    assert megatron["decoder.layers.self_attention.q_layernorm.weight"].shape == (2, 32)
    back = from_megatron(megatron, config)
    assert back.keys() == ours.keys()
    for key in ours:
        assert torch.equal(back[key], ours[key]), key


@pytest.mark.parametrize("shared", [None, 32])
def test_moe_round_trip_is_bit_exact_with_experts_stacked(shared):
    config = gpt_config("tiny_moe", moe_shared_expert_intermediate_size=shared)
    ours = our_state(config)
    megatron = to_megatron(ours.__getitem__, config)
    assert megatron["decoder.layers.mlp.router.weight"].shape == (2, 4, 64)
    assert megatron["decoder.layers.mlp.experts.experts.linear_fc1.weight"].shape == (2, 4, 2 * 64, 64)
    assert megatron["decoder.layers.mlp.experts.experts.linear_fc2.weight"].shape == (2, 4, 64, 64)
    assert "decoder.layers.pre_mlp_layernorm.weight" in megatron and FC1 not in megatron
    assert ("decoder.layers.mlp.shared_experts.linear_fc1.weight" in megatron) == bool(shared)
    back = from_megatron(megatron, config)
    assert back.keys() == ours.keys()
    for key in ours:
        assert torch.equal(back[key], ours[key]), key


def test_fused_qkv_follows_megatron_query_group_split():
    ours = our_state()
    qkv = to_megatron(ours.__getitem__, CONFIG)[QKV][1]
    x = torch.randn(5, CONFIG.hidden_size)
    # Megatron-Core: mixed [sq, ng, (np/ng + 2) * hn] -> split into (np/ng) * hn, hn, hn per group
    groups, head_dim, per_group = 2, CONFIG.head_dim, 4 // 2
    mixed = (x @ qkv.T).view(5, groups, (per_group + 2) * head_dim)
    query, key, value = mixed.split([per_group * head_dim, head_dim, head_dim], dim=-1)
    prefix = "module.layers.1.self_attention."
    torch.testing.assert_close(query.reshape(5, -1), x @ ours[prefix + "q_proj.weight"].T, rtol=0, atol=0)
    torch.testing.assert_close(key.reshape(5, -1), x @ ours[prefix + "k_proj.weight"].T, rtol=0, atol=0)
    torch.testing.assert_close(value.reshape(5, -1), x @ ours[prefix + "v_proj.weight"].T, rtol=0, atol=0)
    gate, up = (x @ to_megatron(ours.__getitem__, CONFIG)[FC1][1].T).chunk(2, dim=-1)
    torch.testing.assert_close(gate, x @ ours["module.layers.1.mlp.gate_proj.weight"].T, rtol=0, atol=0)
    torch.testing.assert_close(up, x @ ours["module.layers.1.mlp.up_proj.weight"].T, rtol=0, atol=0)


def test_tied_embeddings_and_local_spec_norm_names():
    config = gpt_config("tiny", share_embeddings_and_output_weights=True)
    ours = our_state(config)
    megatron = to_megatron(ours.__getitem__, config)
    assert "output_layer.weight" not in megatron
    megatron["decoder.layers.input_layernorm.weight"] = megatron.pop(
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
    )
    back = from_megatron(megatron, config)
    assert all(torch.equal(back[key], ours[key]) for key in ours)


def test_checkpoint_export_and_import_round_trip(tmp_path):
    ours = our_state()
    checkpoint = tmp_path / "ours"
    weights_dir(checkpoint).mkdir(parents=True)
    state = {key: ShardedTensor.from_rank_offsets(key, value, replica_id=0) for key, value in ours.items()}
    dist_checkpointing.save({"state_dict": state}, weights_dir(checkpoint))
    save_context(checkpoint, model=GPTModel(CONFIG), data=SimpleNamespace(tokenizer=ByteLevelTokenizer()))
    exported = export_ckpt(str(checkpoint), str(tmp_path / "mcore"), target="megatron")
    stored = dist_checkpointing.load_tensors_metadata(weights_dir(exported))
    assert "module.decoder.layers.self_attention.linear_qkv.weight" in stored
    assert "module.embedding.word_embeddings.weight" in stored
    back = import_ckpt(f"megatron://{exported}", str(tmp_path / "back"), config=CONFIG)
    loaded = dist_checkpointing.load_plain_tensors(weights_dir(back))
    assert loaded.keys() == ours.keys()
    assert all(torch.equal(loaded[key], ours[key]) for key in ours)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the tokenizer goes with the weights both ways
        assert (hf_artifacts_dir(back) / name).read_bytes() == (hf_artifacts_dir(checkpoint) / name).read_bytes()
    with pytest.raises(ValueError, match="does not match the GPTConfig"):
        import_ckpt(f"megatron://{exported}", str(tmp_path / "bad"), config=gpt_config("tiny", num_layers=3))
    assert not (tmp_path / "bad").exists()


def test_bad_sources_and_targets():
    with pytest.raises(ValueError, match="use hf:///path/to/dir, megatron:///path/to/checkpoint or nemo2:///"):
        import_ckpt("s3://bucket/model", "out")
    with pytest.raises(ValueError, match="needs config=GPTConfig"):
        import_ckpt("megatron:///nowhere", "out")
    with pytest.raises(ValueError, match=r"export_ckpt\(target='onnx'\)"):
        export_ckpt("ckpt", "out", target="onnx")
    with pytest.raises(ValueError, match=r"export_ckpt\(dtype='float33'\)"):
        export_ckpt("ckpt", "out", dtype="float33")
