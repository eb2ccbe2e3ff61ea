"""A checkpoint's `context/`: stored configs rebuild their objects, including configs written before classes moved;
a config naming anything outside the allow-list is refused before it is imported (unless `trust_code=True`); the
data module's tokenizer is stored in `context/hf`."""

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
def test_symbols_outside_the_allow_list_are_refused(tmp_path, module, name):
    model = GPTModel(gpt_config("tiny", num_layers=1))
    raw = json.loads(serialization.dump_json(model.__io__))
    raw["objects"]["buildable_traverser_metadata_1"]["items"][0][1] = {"type": "pyref", "module": module, "name": name}
    (tmp_path / "context").mkdir()
    (tmp_path / "context" / "model.json").write_text(json.dumps(raw))
    with pytest.raises(context.UntrustedConfigError, match=re.escape(f"`{module}.{name}`")):
        context.load_context(tmp_path)


def test_torch_and_lightning_types_of_recipes_are_allowed(tmp_path):
    config = fdl.Config(dict, optim=fdl.Partial(torch.optim.AdamW, lr=0.1), summary=fdl.Config(ModelSummary, 2))
    _write_config(tmp_path, config)
    built = fdl.build(context.load_context(tmp_path))
    assert built["optim"].func is torch.optim.AdamW and built["optim"].keywords == {"lr": 0.1}
    assert isinstance(built["summary"], ModelSummary) and built["summary"]._max_depth == 2


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
