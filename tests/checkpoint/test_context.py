"""A checkpoint's `context/`: stored configs rebuild their objects, including configs written before classes moved."""

import fiddle as fdl
from fiddle.experimental import serialization

from nemo_ckpt.checkpoint import context
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
