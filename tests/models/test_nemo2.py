"""NeMo 2.0 checkpoint directories in and out (`nemo2://`).

The reference context, `nemo2_reference/context/` (`io.json`, `model.yaml`, the tokenizer in `tok/`), was written
by NeMo's own code: nemo-toolkit 2.5.3's `IOMixin.io_dump` of a `TrainerContext` holding `llm.LlamaModel(
llm.Llama32Config1B(<tiny shape>), AutoTokenizer(...))` (`nemo2_reference/make_reference.py` says how; it runs in a
venv of its own, with NVIDIA's `nv_one_logger` stubbed). Its weights are Megatron-Core's naming under `module.`,
which `test_megatron_core_gpt.py` checks against megatron-core's own GPTModel. nemo-toolkit does not install in the
test environment, so the tests that vary the context write it with Fiddle's own serializer (the one NeMo's
`io_dump` calls) from configs of stand-ins registered under NeMo's module and class names; NeMo 2.5.3's
`io.load_context` read an export of ours back into `LlamaModel(Llama31Config(...))` with its `AutoTokenizer`
(checked once by hand, not in the suite).
"""

import dataclasses
import json
import shutil
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import fiddle as fdl
import pytest
import torch
import torch.nn.functional as F
from fiddle.experimental import serialization

from nemo_ckpt import dist_checkpointing
from nemo_ckpt.api import export_ckpt, import_ckpt
from nemo_ckpt.checkpoint.context import load_model, save_context
from nemo_ckpt.checkpoint.layout import context_dir, hf_artifacts_dir, weights_dir
from nemo_ckpt.data.tokenizer import ByteLevelTokenizer
from nemo_ckpt.dist_checkpointing import ShardedTensor
from nemo_ckpt.models import GPT, GPTModel, gpt_config
from nemo_ckpt.models.gpt.convert.nemo2 import nemo_fields
from nemo_ckpt.models.gpt.convert.nemo2_configs import TRANSFORMER_CONFIG_DEFAULTS, PyRef
from tests.helpers.megatron import importorskip_megatron_core

LLM = "nemo.collections.llm.gpt.model"
NEMO_REFERENCE = Path(__file__).parent / "nemo2_reference" / "context"
# A tiny Llama 3.2 (`Llama32Config1B`'s defaults: tied embeddings, rotary base 500000, Llama 3.1 scaling with factor
# 32) with its shape set, as a NeMo recipe would.
LLAMA32 = gpt_config(
    "tiny",
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=128,
    seq_length=64,
    vocab_size=384,
    share_embeddings_and_output_weights=True,
    rotary_base=500000.0,
    rope_scaling=True,
    rope_scaling_factor=32.0,
    rope_original_max_position_embeddings=8192,
)
NEMO_ARGUMENTS = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 128}
NEMO_ARGUMENTS |= {"num_query_groups": 2, "seq_length": 64}


def stand_in(monkeypatch: pytest.MonkeyPatch, module: str, name: str, cls: type) -> type:
    """`cls` registered as `module.name` (so that Fiddle's serializer names it as NeMo's class) for one test."""
    parts = module.split(".")
    for depth in range(1, len(parts) + 1):
        package = ".".join(parts[:depth])
        if package not in sys.modules:
            monkeypatch.setitem(sys.modules, package, types.ModuleType(package))
    cls.__module__, cls.__name__, cls.__qualname__ = module, name, name
    setattr(sys.modules[module], name, cls)
    return cls


class _Anything:
    def __init__(self, *args, **kwargs) -> None:
        self.kwargs = kwargs


@pytest.fixture
def nemo_classes(monkeypatch):
    """Stand-ins for the NeMo classes a checkpoint's context names; removed again after the test."""
    names = {
        "trainer_context": ("nemo.lightning.io.pl", "TrainerContext"),
        "trainer": ("nemo.lightning.pytorch.trainer", "Trainer"),
        "strategy": ("nemo.lightning.pytorch.strategies.megatron_strategy", "MegatronStrategy"),
        "model": (f"{LLM}.llama", "LlamaModel"),
        "qwen2_model": (f"{LLM}.qwen2", "Qwen2Model"),
        "qwen3_model": (f"{LLM}.qwen3", "Qwen3Model"),
        "mixtral_model": (f"{LLM}.mixtral", "MixtralModel"),
        "config": (f"{LLM}.llama", "Llama32Config1B"),
        "llama_config": (f"{LLM}.llama", "LlamaConfig"),
        "llama31_config": (f"{LLM}.llama", "Llama31Config"),
        "gpt_config": (f"{LLM}.base", "GPTConfig"),
        "qwen2_config": (f"{LLM}.qwen2", "Qwen2Config"),
        "qwen3_config": (f"{LLM}.qwen3", "Qwen3Config"),
        "mixtral_config": (f"{LLM}.mixtral", "MixtralConfig"),
        "gemma": (f"{LLM}.gemma", "GemmaConfig"),
        "tokenizer": ("nemo.collections.common.tokenizers.huggingface.auto_tokenizer", "AutoTokenizer"),
        "layer_spec": (f"{LLM}.base", "default_layer_spec"),
    }
    classes = {
        key: stand_in(monkeypatch, module, name, type(name, (_Anything,), {})) for key, (module, name) in names.items()
    }
    serialization.register_constant("torch", "bfloat16", compare_by_identity=True)  # as NeMo's fdl_torch does
    return SimpleNamespace(**classes)


def save_ours(directory: Path, config=LLAMA32) -> tuple[Path, dict[str, torch.Tensor]]:
    """A checkpoint of ours of a random GPT with `config` (distinct values everywhere, norms and biases included),
    storing a tokenizer."""
    torch.manual_seed(0)
    model = GPT(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    state = {f"module.{key}": value for key, value in model.state_dict().items()}
    weights_dir(directory).mkdir(parents=True)
    sharded = {key: ShardedTensor.from_rank_offsets(key, value, replica_id=0) for key, value in state.items()}
    dist_checkpointing.save({"state_dict": sharded}, weights_dir(directory))
    save_context(directory, model=GPTModel(config), data=SimpleNamespace(tokenizer=ByteLevelTokenizer()))
    return directory, state


def nemo_reference(tmp_path: Path, classes: SimpleNamespace, config_fdl: fdl.Config) -> Path:
    """A NeMo 2.0 checkpoint of `LLAMA32`'s weights, its context as NeMo writes it: `io.json` of a TrainerContext
    (model, trainer with its strategy, extra), the tokenizer's files in `context/nemo_tokenizer/`."""
    ours, _ = save_ours(tmp_path / "ours")
    nemo = export_ckpt(str(ours), str(tmp_path / "nemo"), target="megatron")  # weights under module.
    context = context_dir(nemo)
    for path in sorted(context.rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    (context / "nemo_tokenizer").mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (context / "nemo_tokenizer" / name).write_bytes((hf_artifacts_dir(ours) / name).read_bytes())
    tokenizer = fdl.Config(classes.tokenizer, pretrained_model_name="nemo_tokenizer")
    model = fdl.Config(classes.model, config=config_fdl, tokenizer=tokenizer)
    strategy = fdl.Config(classes.strategy, tensor_model_parallel_size=1, ckpt_async_save=True)
    trainer = fdl.Config(classes.trainer, devices=2, accelerator="gpu", strategy=strategy, max_steps=10)
    root = fdl.Config(classes.trainer_context, model=model, trainer=trainer, extra={"datamodule": None})
    (context / "io.json").write_text(serialization.dump_json(root))
    (context / "model.yaml").write_text("_target_: nemo.collections.llm.gpt.model.llama.LlamaModel\n")
    return nemo


def llama32(classes, **more) -> fdl.Config:
    """`Llama32Config1B(...)` as a recipe sets it: the shape, plus fields that do not change the model."""
    extra = {"params_dtype": torch.bfloat16, "bf16": True, "tensor_model_parallel_size": 1}
    extra |= {"transformer_layer_spec": classes.layer_spec, "apply_rope_fusion": True, "attention_dropout": 0.0}
    return fdl.Config(classes.config, **(NEMO_ARGUMENTS | extra | more))


def test_imports_a_checkpoint_nemo_wrote_with_its_config_class_defaults_and_tokenizer(tmp_path):
    ours, state = save_ours(tmp_path / "ours")
    nemo = export_ckpt(str(ours), str(tmp_path / "nemo"), target="megatron")  # the weights, under module.
    shutil.rmtree(context_dir(nemo))
    shutil.copytree(NEMO_REFERENCE, context_dir(nemo))
    imported = import_ckpt(f"nemo2://{nemo}", str(tmp_path / "imported"))
    model = load_model(imported)
    assert model.config == LLAMA32  # Llama32Config1B's defaults filled what NeMo did not store
    loaded = dist_checkpointing.load_plain_tensors(weights_dir(imported))
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[key], state[key]) for key in state)
    tokens = torch.arange(48).view(2, 24)
    with torch.no_grad():
        assert torch.equal(model(tokens), load_model(ours)(tokens))
    tokenizer = (NEMO_REFERENCE / "tok" / "tokenizer.json").read_bytes()
    assert (hf_artifacts_dir(imported) / "tokenizer.json").read_bytes() == tokenizer


@pytest.mark.parametrize(
    "config",
    [
        LLAMA32,
        gpt_config("tiny", num_query_groups=2, add_qkv_bias=True, vocab_size=300),
        gpt_config("tiny", qk_layernorm=True, kv_channels=32, share_embeddings_and_output_weights=True),
        gpt_config("tiny", num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, moe_aux_loss_coeff=0.01),
    ],
    ids=["llama3.2", "qwen2", "qwen3", "mixtral"],
)
def test_export_writes_nemos_layout_and_imports_back_bit_exact(tmp_path, nemo_classes, config):
    checkpoint, ours = save_ours(tmp_path / "ours", config)
    exported = export_ckpt(str(checkpoint), str(tmp_path / "nemo"), target="nemo2")
    context = context_dir(exported)
    assert {"io.json", "model.yaml", "nemo_tokenizer"} <= {path.name for path in context.iterdir()}
    assert not (context / "model.json").exists() and not (context / "hf").exists()  # NeMo's context, not ours
    stored = dist_checkpointing.load_tensors_metadata(weights_dir(exported))
    assert "module.decoder.layers.self_attention.linear_qkv.weight" in stored
    # Fiddle's own loader reads it (with NeMo's classes; stand-ins here) into NeMo's model, config and tokenizer
    root = serialization.load_json((context / "io.json").read_text())
    assert fdl.get_callable(root) is nemo_classes.trainer_context
    assert fdl.get_callable(root.model.tokenizer) is nemo_classes.tokenizer
    assert root.model.config.num_layers == config.num_layers and root.model.config.activation_func is F.silu
    back = import_ckpt(f"nemo2://{exported}", str(tmp_path / "back"))
    assert load_model(back, load_weights=False).config == config
    loaded = dist_checkpointing.load_plain_tensors(weights_dir(back))
    assert loaded.keys() == ours.keys() and all(torch.equal(loaded[key], ours[key]) for key in ours)
    assert (hf_artifacts_dir(back) / "tokenizer.json").read_bytes() == (
        hf_artifacts_dir(checkpoint) / "tokenizer.json"
    ).read_bytes()


def nemo_fields_of_megatron_core() -> set[str]:
    transformer_config = importorskip_megatron_core("megatron.core.transformer.transformer_config")
    return {f.name for f in dataclasses.fields(transformer_config.TransformerConfig)}


def test_exported_fields_and_defaults_are_megatron_cores():
    """Every field an export sets is megatron-core's `TransformerConfig`'s or one NeMo's GPTConfig / Llama31Config
    declares, and the table's `TransformerConfig` defaults are the installed megatron-core's."""
    fields = nemo_fields_of_megatron_core()
    nemo_gpt_config = {"make_vocab_size_divisible_by", "share_embeddings_and_output_weights", "seq_length"}
    nemo_gpt_config |= {"position_embedding_type", "rotary_base", "rotary_percent", "seq_len_interpolation_factor"}
    nemo_gpt_config |= {"vocab_size", "scale_factor", "low_freq_factor", "high_freq_factor", "old_context_len"}
    for config in (LLAMA32, gpt_config("tiny", num_moe_experts=4)):
        assert set(nemo_fields(config)) - fields - nemo_gpt_config == set()
    transformer_config = importorskip_megatron_core("megatron.core.transformer.transformer_config").TransformerConfig
    for f in dataclasses.fields(transformer_config):
        if f.name in TRANSFORMER_CONFIG_DEFAULTS:
            ours = TRANSFORMER_CONFIG_DEFAULTS[f.name]
            default = PyRef("torch.nn.functional", f.default.__name__) if callable(f.default) else f.default
            assert ours == default, f.name
    assert set(TRANSFORMER_CONFIG_DEFAULTS) <= fields


def refused(tmp_path: Path, nemo: Path, match: str) -> None:
    with pytest.raises(ValueError, match=match):  # NeMoContextError, or the weights not matching the context
        import_ckpt(f"nemo2://{nemo}", str(tmp_path / "refused"))
    assert not (tmp_path / "refused").exists()


def rewrite_io_json(nemo: Path, root: fdl.Config) -> None:
    (context_dir(nemo) / "io.json").write_text(serialization.dump_json(root))


def test_refuses_what_our_gpt_cannot_express_or_this_reader_does_not_know(tmp_path, nemo_classes):
    nemo = nemo_reference(tmp_path, nemo_classes, llama32(nemo_classes))
    root = serialization.load_json((context_dir(nemo) / "io.json").read_text())
    cases = [
        (fdl.Config(nemo_classes.gpt_config, **NEMO_ARGUMENTS), r"cannot express normalization=LayerNorm.*activation"),
        (fdl.Config(nemo_classes.gemma, **NEMO_ARGUMENTS), r"model.config is `.*gemma.GemmaConfig`, which is not one"),
        (llama32(nemo_classes, mtp_num_layers=1), r"sets \['mtp_num_layers'\], which this converter does not know"),
        (llama32(nemo_classes, window_size=[16, 0]), r"window_size=\[16, 0\]: a sliding window shorter"),
        (llama32(nemo_classes, vocab_size=500), r"vocab_size=500, but the weights' embedding has 384 rows"),
        (llama32(nemo_classes, num_layers=3), r"does not match the GPTConfig"),
    ]
    for config, match in cases:
        root.model.config = config
        rewrite_io_json(nemo, root)
        refused(tmp_path, nemo, match)


def test_reads_the_context_as_data_and_nothing_outside_the_checkpoint(tmp_path, nemo_classes):
    nemo = nemo_reference(tmp_path, nemo_classes, llama32(nemo_classes))
    io_json = context_dir(nemo) / "io.json"
    raw = json.loads(io_json.read_text())
    config_key = next(key for key in raw["objects"] if key.startswith("llama32_config1_b"))
    # a field holding a call of code (a Partial of os.system) is named and refused, never imported or built
    call = {"type": {"type": "pyref", "module": "fiddle._src.partial", "name": "Partial"}, "items": []}
    call["metadata"] = {"type": "ref", "key": "evil_metadata"}
    metadata_type = {"type": "pyref", "module": "fiddle._src.config", "name": "BuildableTraverserMetadata"}
    raw["objects"]["evil_metadata"] = {
        "type": metadata_type,
        "items": [["Attr(name='fn_or_cls')", {"type": "pyref", "module": "os", "name": "system"}]],
        "metadata": metadata_type,
    }
    raw["objects"]["evil"] = call
    raw["objects"][config_key]["items"].append(["Attr(name='init_method')", {"type": "ref", "key": "evil"}])
    raw["objects"][config_key]["items"].append(["Attr(name='hidden_dropout')", {"type": "ref", "key": "evil"}])
    io_json.write_text(json.dumps(raw))
    refused(tmp_path, nemo, r"model.config.hidden_dropout is `os.system`, not a plain value")

    nemo = nemo_reference(tmp_path / "second", nemo_classes, llama32(nemo_classes))
    root = serialization.load_json((context_dir(nemo) / "io.json").read_text())
    root.model.tokenizer.pretrained_model_name = str(tmp_path / "ours" / "context" / "hf")
    rewrite_io_json(nemo, root)
    refused(tmp_path, nemo, r"pretrained_model_name=.* points outside the checkpoint's context/")
    root.model.tokenizer.pretrained_model_name = "../../ours/context/hf"
    rewrite_io_json(nemo, root)
    refused(tmp_path, nemo, r"points outside the checkpoint's context/")
    with pytest.raises(FileNotFoundError, match="is not a NeMo 2.0 checkpoint: .*io.json is missing"):
        import_ckpt(f"nemo2://{tmp_path / 'ours'}", str(tmp_path / "out"))


def test_options_that_do_not_apply_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"takes the model config from context/io.json; drop config="):
        import_ckpt("nemo2:///nowhere", "out", config=LLAMA32)
    with pytest.raises(ValueError, match=r"keeps the checkpoint's embedding rows; drop make_vocab_size_divisible_by"):
        import_ckpt("nemo2:///nowhere", "out", make_vocab_size_divisible_by=128)
    with pytest.raises(ValueError, match=r"export_ckpt\(target='nemo2'\) writes .*drop \['dtype'\]"):
        export_ckpt("ckpt", "out", target="nemo2", dtype="bfloat16")
