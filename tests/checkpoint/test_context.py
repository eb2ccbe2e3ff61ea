"""A checkpoint's `context/`: stored configs rebuild their objects, including configs written before classes moved,
read as data, as Fiddle's own loader reads them; a config naming anything outside the registry is refused before it
is imported, saying what and where (unless `trust_code=True`); the data module's tokenizer is stored in `context/hf`.
The attack corpus is in `test_untrusted_configs.py`."""

import json
import re
import subprocess
from types import SimpleNamespace

import fiddle as fdl
import pytest
import torch
from fiddle.experimental import serialization
from lightning.pytorch.callbacks import ModelSummary

from nemo_ckpt.checkpoint import AutoResume, context
from nemo_ckpt.checkpoint.layout import hf_artifacts_dir
from nemo_ckpt.data import MockDataModule
from nemo_ckpt.data.tokenizer import ByteLevelTokenizer, HFTokenizer
from nemo_ckpt.models import GPTModel, gpt_config
from nemo_ckpt.optim import OptimizerConfig
from nemo_ckpt.peft import LoRA


def test_saved_config_rebuilds_an_equal_model(tmp_path):
    model = GPTModel(gpt_config("tiny", num_layers=1), OptimizerConfig(lr=0.5))
    assert context.save_context(tmp_path, model=model, data=object()) == ["model"]
    rebuilt = fdl.build(context.load_context(tmp_path, "model"))
    assert isinstance(rebuilt, GPTModel) and rebuilt.config == model.config and rebuilt.optim.lr == 0.5


def test_config_written_by_0_1_names_the_old_modules_and_still_loads(tmp_path):
    model = GPTModel(gpt_config("tiny", num_layers=1))
    old = serialization.dump_json(model.__io__).replace(
        '"nemo_ckpt.models.gpt.lightning"', '"nemo_ckpt.models.lightning"'
    )
    old = old.replace('"nemo_ckpt.models.gpt.model"', '"nemo_ckpt.models.gpt"')
    assert '"nemo_ckpt.models.lightning"' in old
    (tmp_path / "context").mkdir()
    (tmp_path / "context" / "model.json").write_text(old)
    rebuilt = fdl.build(context.load_context(tmp_path, "model"))
    assert isinstance(rebuilt, GPTModel) and rebuilt.config == model.config


def _write_config(checkpoint, config) -> None:
    (checkpoint / "context").mkdir(parents=True, exist_ok=True)
    (checkpoint / "context" / "model.json").write_text(serialization.dump_json(config))


def test_config_naming_subprocess_is_refused_before_it_runs(tmp_path):
    marker = tmp_path / "ran"
    _write_config(tmp_path, fdl.Config(subprocess.run, ["touch", str(marker)]))
    with pytest.raises(context.UntrustedConfigError, match=r"`subprocess.run`.*trust_code=True"):
        context.load_model(tmp_path, load_weights=False)
    with pytest.raises(context.UntrustedConfigError, match="subprocess.run"):
        AutoResume(restore_config=True).restore_model(tmp_path, model=None)
    assert not marker.exists()
    fdl.build(context.load_context(tmp_path, "model", trust_code=True))  # the documented opt-in
    assert marker.exists()


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("builtins", "eval"),
        ("os", "system"),
        ("nemo_ckpt.checkpoint.context", "json.loads"),  # re-exported by an allowed module
        ("nemo_ckpt.checkpoint.context", "IOMixin.__init_subclass__.__globals__"),
        ("torch", "load"),
    ],
)
def test_symbols_outside_the_registry_are_refused(tmp_path, module, name):
    model = GPTModel(gpt_config("tiny", num_layers=1))
    raw = json.loads(serialization.dump_json(model.__io__))
    raw["objects"]["buildable_traverser_metadata_1"]["items"][0][1] = {"type": "pyref", "module": module, "name": name}
    (tmp_path / "context").mkdir()
    (tmp_path / "context" / "model.json").write_text(json.dumps(raw))
    with pytest.raises(context.UntrustedConfigError, match=re.escape(f"`{module}.{name}`")):
        context.load_context(tmp_path)


def test_configs_of_every_stored_kind_read_as_fiddle_reads_them(tmp_path):
    optim = OptimizerConfig(optimizer="sgd", lr_decay_steps=7)
    lora = LoRA(target_modules=("q_proj", "v_proj"), dim=4, alpha=8, base_checkpoint=str(tmp_path / "base"))
    model = GPTModel(gpt_config("tiny", num_layers=1, moe_layer_freq=[1], vocab_size=None), optim, lora)
    context.save_context(tmp_path, model=model)
    stored = (tmp_path / "context" / "model.json").read_text()
    config = context.load_context(tmp_path)
    assert config == serialization.load_json(stored) == model.__io__
    assert isinstance(config.peft.target_modules, tuple)
    rebuilt = fdl.build(config)
    assert (rebuilt.config, rebuilt.optim, rebuilt.peft) == (model.config, optim, lora)


def test_refusal_says_what_it_found_and_where(tmp_path):
    config = context.to_config(gpt_config("tiny"))
    _write_config(tmp_path, fdl.Config(GPTModel, config, peft=fdl.Config(subprocess.run, ["true"])))
    with pytest.raises(context.UntrustedConfigError) as refused:
        context.load_context(tmp_path)
    message = str(refused.value)
    assert message.startswith(f"{tmp_path / 'context' / 'model.json'} at $.objects['buildable_traverser_metadata_")
    assert "(<root>.peft): `subprocess.run`, which is not in the registry" in message
    assert "GPTModel, GPTConfig, OptimizerConfig, LoRA" in message and "trust_code=True" in message


def test_torch_and_lightning_types_are_refused_unless_trusted(tmp_path):
    config = fdl.Config(dict, optim=fdl.Partial(torch.optim.AdamW, lr=0.1), summary=fdl.Config(ModelSummary, 2))
    _write_config(tmp_path, config)
    with pytest.raises(context.UntrustedConfigError, match="`builtins.dict`, which is not in the registry"):
        context.load_context(tmp_path)
    built = fdl.build(context.load_context(tmp_path, trust_code=True))
    assert built["optim"].func is torch.optim.AdamW and built["optim"].keywords == {"lr": 0.1}
    assert isinstance(built["summary"], ModelSummary) and built["summary"]._max_depth == 2
    with pytest.raises(ValueError, match="does not describe a model: it builds <class 'dict'>"):
        context.load_model(tmp_path, trust_code=True)


class DocumentIds(ByteLevelTokenizer):
    """A tokenizer of a type the Hugging Face files cannot describe (its ids are not the bytes')."""

    vocab_size = 1100


def test_saved_context_holds_the_data_modules_tokenizer(tmp_path, caplog):
    model = GPTModel(gpt_config("tiny", num_layers=1))
    data = SimpleNamespace(tokenizer=ByteLevelTokenizer())  # a data module's `tokenizer`, e.g. PreTrainingDataModule's
    assert context.save_context(tmp_path / "ckpt", model=model, data=data) == ["model"]
    stored = hf_artifacts_dir(tmp_path / "ckpt")
    assert sorted(p.name for p in stored.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    assert HFTokenizer(stored).text_to_ids("naïve 🤖") == ByteLevelTokenizer().text_to_ids("naïve 🤖")

    context.save_context(tmp_path / "mock", model=model, data=MockDataModule(seq_length=8))  # no tokenizer
    assert not hf_artifacts_dir(tmp_path / "mock").exists()
    context.save_context(tmp_path / "other", model=model, data=SimpleNamespace(tokenizer=DocumentIds()))
    assert not hf_artifacts_dir(tmp_path / "other").exists()
    assert "a DocumentIds is not stored with the checkpoint" in caplog.text
