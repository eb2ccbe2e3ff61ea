"""Hugging Face Llama <-> our checkpoints: bit-exact round trips, equal logits, bad input; exports carry the
tokenizer the weights were trained with (`AutoTokenizer` gives its ids) and its bos/eos/pad ids."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from nemo_ckpt import dist_checkpointing  # noqa: E402
from nemo_ckpt.checkpoint.context import load_model, save_context  # noqa: E402
from nemo_ckpt.checkpoint.layout import hf_artifacts_dir, is_complete, weights_dir  # noqa: E402
from nemo_ckpt.conversion import export_ckpt  # noqa: E402
from nemo_ckpt.data.tokenizer import ByteLevelTokenizer, SentencePieceTokenizer, Tokenizer  # noqa: E402
from nemo_ckpt.dist_checkpointing import ShardedTensor, cli  # noqa: E402
from nemo_ckpt.models import GPTConfig, GPTModel, gpt_config  # noqa: E402
from nemo_ckpt.models.gpt.convert import export_hf, import_hf  # noqa: E402
from nemo_ckpt.models.gpt.convert.safetensors_io import (  # noqa: E402
    INDEX_FILE,
    MalformedModelError,
    open_model_weights,
)
from nemo_ckpt.models.gpt.model import padded_vocab_size  # noqa: E402
from tests.helpers.tokenizers import TEXT, train_sentencepiece  # noqa: E402

TINY_LLAMA = dict(
    vocab_size=100,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
)


def make_hf_llama(directory: Path, dtype: torch.dtype = torch.float32, max_shard_size=None, **overrides) -> Path:
    """A tiny random `LlamaForCausalLM` saved to `directory` (no download)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**TINY_LLAMA, **overrides})
    model = transformers.LlamaForCausalLM(config).to(dtype)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, **kwargs)
    return directory


def hf_logits(directory: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        return model(tokens).logits


def our_logits(checkpoint: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = load_model(checkpoint)
    with torch.no_grad():
        return model.float()(tokens)


CONFIGS = {
    "gqa": dict(num_key_value_heads=2),
    "tied": dict(tie_word_embeddings=True),
    "rope_theta": dict(rope_theta=500000.0, num_key_value_heads=1),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_import_matches_transformers_and_round_trips_bit_exact(tmp_path, name):
    source = make_hf_llama(tmp_path / "hf", **CONFIGS[name])
    checkpoint = import_hf(source, tmp_path / "ours")
    assert is_complete(checkpoint)
    tokens = torch.randint(100, (2, 12))
    torch.testing.assert_close(our_logits(checkpoint, tokens), hf_logits(source, tokens), atol=1e-5, rtol=0)
    exported = export_hf(checkpoint, tmp_path / "back")
    original, back = open_model_weights(source), open_model_weights(exported)
    assert original.keys() - {"lm_head.weight"} == back.keys() - {"lm_head.weight"}
    for key in back:
        assert back[key].dtype == original[key].dtype and torch.equal(back[key], original[key]), key
    torch.testing.assert_close(hf_logits(exported, tokens), hf_logits(source, tokens), atol=0, rtol=0)


def test_bf16_sharded_with_vocab_padding(tmp_path):
    source = make_hf_llama(tmp_path / "hf", dtype=torch.bfloat16, max_shard_size="20KB")
    assert (source / INDEX_FILE).is_file()
    for tensor in open_model_weights(source).values():  # memory-mapped, each owning exactly its bytes: written
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()  # without a staging copy
    checkpoint = import_hf(source, tmp_path / "ours", make_vocab_size_divisible_by=64)
    assert cli.main(["verify", str(checkpoint)]) == 0  # weights/ and context/, each with its checksums
    assert (checkpoint / "context" / "checksums.json").is_file()
    stored = dist_checkpointing.load_plain_tensors(weights_dir(checkpoint))
    assert stored["module.embedding.weight"].dtype == torch.bfloat16
    assert stored["module.embedding.weight"].shape[0] == 128 and not stored["module.embedding.weight"][100:].any()
    tokens = torch.randint(100, (1, 8))
    torch.testing.assert_close(our_logits(checkpoint, tokens)[..., :100], hf_logits(source, tokens), atol=1e-5, rtol=0)
    exported = export_hf(checkpoint, tmp_path / "back", max_shard_size=20_000)
    assert (exported / INDEX_FILE).is_file()
    assert json.loads((exported / "config.json").read_text())["vocab_size"] == 100
    original, back = open_model_weights(source), open_model_weights(exported)
    assert original.keys() == back.keys()
    for key in back:
        assert back[key].dtype == torch.bfloat16 and torch.equal(back[key], original[key]), key


def save_word_level_tokenizer(directory: Path, num_tokens: int, eos_token: str | None = None) -> None:
    """A tokenizer of `num_tokens` words `t0`, `t1`, ... (the last one `<unk>`; `eos_token` the one before), saved
    as transformers does."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"t{i}" for i in range(num_tokens - 2)] + [eos_token or f"t{num_tokens - 2}", "<unk>"]
    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token=eos_token)
    tokenizer.save_pretrained(directory)


def test_export_carries_the_tokenizer(tmp_path):
    source = make_hf_llama(tmp_path / "hf")
    save_word_level_tokenizer(source, num_tokens=100)
    checkpoint = import_hf(source, tmp_path / "ours")
    assert (hf_artifacts_dir(checkpoint) / "tokenizer.json").is_file()
    exported = export_hf(checkpoint, tmp_path / "back")
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    assert tokenizer("t3 t7")["input_ids"] == [3, 7]


def save_gpt(checkpoint: Path, config: GPTConfig, tokenizer: Tokenizer) -> None:
    """A checkpoint of a random GPT trained here on data tokenized by `tokenizer` (what ModelCheckpoint stores)."""
    torch.manual_seed(0)
    model = GPTModel(config)
    model.configure_model()
    weights_dir(checkpoint).mkdir(parents=True)
    state = {
        key: ShardedTensor.from_rank_offsets(key, value, replica_id=0) for key, value in model.state_dict().items()
    }
    dist_checkpointing.save({"state_dict": state}, weights_dir(checkpoint))
    save_context(checkpoint, model=model, data=SimpleNamespace(tokenizer=tokenizer))


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece"])
def test_export_of_a_model_pretrained_here_loads_with_its_tokenizer(tmp_path, kind):
    if kind == "byte-level":
        tokenizer = ByteLevelTokenizer()
    else:
        tokenizer = SentencePieceTokenizer(train_sentencepiece(tmp_path / "spm"))
    rows = padded_vocab_size(tokenizer.vocab_size, 128)  # a vocabulary padded beyond the tokenizer's, kept
    save_gpt(tmp_path / "ours", gpt_config("tiny", vocab_size=rows), tokenizer)
    exported = export_ckpt(str(tmp_path / "ours"), str(tmp_path / "hf"))
    loaded = transformers.AutoTokenizer.from_pretrained(exported)
    ids = tokenizer.text_to_ids(TEXT)
    assert loaded(TEXT)["input_ids"] == ids and loaded.eos_token_id == loaded.pad_token_id == tokenizer.eod
    config = json.loads((exported / "config.json").read_text())
    generation = json.loads((exported / "generation_config.json").read_text())
    bos = {"byte-level": 256, "sentencepiece": 1}[kind]
    for stored in (config, generation):
        assert (stored["bos_token_id"], stored["eos_token_id"], stored["pad_token_id"]) == (
            bos,
            tokenizer.eod,
            tokenizer.eod,
        )
    assert config["vocab_size"] == rows > tokenizer.vocab_size
    tokens = torch.tensor([ids])
    torch.testing.assert_close(hf_logits(exported, tokens), our_logits(tmp_path / "ours", tokens), atol=1e-5, rtol=0)
    assert transformers.AutoModelForCausalLM.from_pretrained(exported).generation_config.eos_token_id == tokenizer.eod


def test_export_of_an_import_takes_the_token_ids_from_its_tokenizer(tmp_path):
    source = make_hf_llama(tmp_path / "hf")  # LlamaConfig's default ids: bos 1, eos 2, which this tokenizer lacks
    save_word_level_tokenizer(source, num_tokens=100, eos_token="<eod>")
    exported = export_hf(import_hf(source, tmp_path / "ours"), tmp_path / "back")
    loaded = transformers.AutoTokenizer.from_pretrained(exported)
    assert loaded.eos_token_id == loaded.pad_token_id == 98  # pad = eos, as NeMo's Llama export sets it
    for name in ("config.json", "generation_config.json"):
        stored = json.loads((exported / name).read_text())
        assert (stored["bos_token_id"], stored["eos_token_id"], stored["pad_token_id"]) == (None, 98, 98), name


def test_export_refuses_a_tokenizer_larger_than_the_vocabulary(tmp_path):
    save_gpt(tmp_path / "ours", gpt_config("tiny", vocab_size=200), ByteLevelTokenizer())
    with pytest.raises(ValueError, match="has 257 tokens but the exported model's vocab_size is 200"):
        export_hf(tmp_path / "ours", tmp_path / "hf")
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".tmp-*"))


def test_bad_input_names_the_problem_and_writes_nothing(tmp_path):
    source = make_hf_llama(tmp_path / "hf")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(
        json.dumps({**config, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        import_hf(source, tmp_path / "out")
    (source / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match=r"num_hidden_layers=3, but the weights hold layers \[0, 1\]"):
        import_hf(source, tmp_path / "out")
    (source / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    with pytest.raises(ValueError, match="model.layers.0.mlp.gate_proj.weight.*shape"):
        import_hf(source, tmp_path / "out")
    (source / "config.json").write_text(json.dumps(config))
    save_word_level_tokenizer(source, num_tokens=150)
    with pytest.raises(ValueError, match="has 150 tokens but .*vocab_size=100"):
        import_hf(source, tmp_path / "out")
    sharded = make_hf_llama(tmp_path / "sharded", max_shard_size="20KB")
    next(sharded.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of"):
        import_hf(sharded, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "sharded"]
    existing = tmp_path / "hf"
    with pytest.raises(FileExistsError, match="overwrite=True"):
        import_hf(sharded, existing)


def _rewrite_config(source: Path, **changes) -> None:
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, **changes}))


def _rewrite_header(path: Path, change) -> None:
    """`path` (a safetensors file) with `change(header)` applied to its header, its data kept."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    change(header)
    encoded = json.dumps(header).encode()
    path.write_bytes(len(encoded).to_bytes(8, "little") + encoded + raw[8 + length :])


def _first_tensor(header: dict) -> dict:
    return header[min(name for name in header if name != "__metadata__")]


def _overlap(header: dict) -> None:
    """The second layer norm's data where the first one's is."""
    layer = "model.layers.0.{}_layernorm.weight"
    header[layer.format("post_attention")]["data_offsets"] = header[layer.format("input")]["data_offsets"]


def _misplace(weight_map: dict[str, str]) -> None:
    here = weight_map["model.norm.weight"]
    weight_map["model.norm.weight"] = next(name for name in sorted(set(weight_map.values())) if name != here)


def _all_in(name: str):
    return lambda weight_map: weight_map.update(dict.fromkeys(weight_map, name))


def _rewrite_index(source: Path, change) -> None:
    index = json.loads((source / INDEX_FILE).read_text())
    change(index["weight_map"])
    (source / INDEX_FILE).write_text(json.dumps(index))


def _link_outside(source: Path) -> None:
    first = sorted(source.glob("model-*.safetensors"))[0]
    outside = source.parent / "outside.safetensors"
    first.rename(outside)
    first.symlink_to(outside)


MALFORMED = {
    "layers as a float": (lambda s: _rewrite_config(s, num_hidden_layers=1e9), "num_hidden_layers=1000000000.0 is not"),
    "a billion layers": (lambda s: _rewrite_config(s, num_hidden_layers=10**9), r"weights hold layers \[0, 1\]"),
    "huge vocabulary": (lambda s: _rewrite_config(s, vocab_size=10**12), r"embed_tokens.weight has shape \[100, 32\]"),
    "hidden size as text": (lambda s: _rewrite_config(s, hidden_size="32"), "hidden_size='32' is not a positive"),
    "no heads": (lambda s: _rewrite_config(s, num_attention_heads=0), "num_attention_heads=0 is not a positive"),
    "rope theta": (lambda s: _rewrite_config(s, rope_theta="x"), "rope_theta='x' is not a positive number"),
    "config not JSON": (lambda s: (s / "config.json").write_text("{nope"), "config.json is not JSON"),
    "config a list": (lambda s: (s / "config.json").write_text("[1]"), "config.json is not a JSON object"),
    "header length": (
        lambda s: (s / "model.safetensors").write_bytes((2**63).to_bytes(8, "little") + b"{}"),
        "header length 9223372036854775808 exceeds",
    ),
    "header not JSON": (
        lambda s: (s / "model.safetensors").write_bytes((4).to_bytes(8, "little") + b"{nop"),
        "the header is not JSON",
    ),
    "negative offset": (
        lambda s: _rewrite_header(s / "model.safetensors", lambda h: _first_tensor(h).update(data_offsets=[-8, 0])),
        r"data_offsets \[-8, 0\], not \[begin, end\]",
    ),
    "offset past the end": (
        lambda s: _rewrite_header(
            s / "model.safetensors", lambda h: _first_tensor(h).update(data_offsets=[2**40, 2**40 + 128])
        ),
        "is truncated: tensor",
    ),
    "overlapping tensors": (
        lambda s: _rewrite_header(s / "model.safetensors", _overlap),
        "the data of tensors .* overlap",
    ),
    "shape and bytes disagree": (
        lambda s: _rewrite_header(s / "model.safetensors", lambda h: _first_tensor(h).update(shape=[10**9, 10**9])),
        "has 4000000000000000000 bytes, but its data_offsets",
    ),
    "index escapes": (lambda s: _rewrite_index(s, _all_in("../x.safetensors")), "not a file inside"),
    "index absolute": (lambda s: _rewrite_index(s, _all_in("/etc/passwd")), "not a file inside"),
    "index link outside": (_link_outside, "not a file inside"),
    "index not JSON": (lambda s: (s / INDEX_FILE).write_text("[]"), "is not a shard index with a weight_map"),
    "index misplaces": (
        lambda s: _rewrite_index(s, _misplace),
        "holds tensor 'model.norm.weight', which .* places in",
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_files_raise_a_named_error_before_anything_is_allocated(tmp_path, case):
    change, message = MALFORMED[case]
    sharded = case.startswith("index")
    source = make_hf_llama(tmp_path / "hf", max_shard_size="20KB" if sharded else None)
    change(source)
    with pytest.raises(MalformedModelError, match=message):
        import_hf(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


TWO_RANK_RUNS = {
    "fsdp2": {"ddp": {"data_parallel_sharding_strategy": "optim_grads_params"}},
    "tp2": {"ddp": {}, "tensor_model_parallel_size": 2},
}


def test_export_from_two_rank_fsdp2_and_tp_checkpoints(tmp_path):
    from tests.helpers.distributed import run_distributed
    from tests.models.two_rank_training import train_and_save

    run_distributed(train_and_save, 2, TWO_RANK_RUNS, tmp_path)
    tokens = torch.randint(256, (2, 16))
    for name in TWO_RANK_RUNS:
        checkpoint = tmp_path / name
        save_context(checkpoint, model=GPTModel(gpt_config("tiny")))
        exported = export_hf(checkpoint, tmp_path / f"{name}-hf")
        torch.testing.assert_close(hf_logits(exported, tokens), our_logits(checkpoint, tokens), atol=1e-5, rtol=0)
