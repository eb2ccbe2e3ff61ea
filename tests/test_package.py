"""The package's public surface: `from nemo_ckpt import ...` names, imported lazily."""

import importlib
import subprocess
import sys

import pytest

import nemo_ckpt


def test_public_names_import():
    from nemo_ckpt import AutoResume, MegatronStrategy, ModelCheckpoint, NeMoLogger, dist_checkpointing, pretrain

    assert MegatronStrategy.__module__ == "nemo_ckpt.strategy.megatron_strategy"
    assert {ModelCheckpoint.__name__, AutoResume.__name__, NeMoLogger.__name__, pretrain.__name__} == {
        "ModelCheckpoint",
        "AutoResume",
        "NeMoLogger",
        "pretrain",
    }
    assert dist_checkpointing.save.__module__ == "nemo_ckpt.dist_checkpointing.serialization"
    assert set(nemo_ckpt.__all__) >= {
        "MegatronStrategy",
        "ModelCheckpoint",
        "AutoResume",
        "NeMoLogger",
        "pretrain",
        "dist_checkpointing",
    }


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'MegatronStrtegy'"):
        nemo_ckpt.MegatronStrtegy  # noqa: B018


def test_checkpoint_and_log_readers_do_not_load_lightning():
    """`dist_checkpointing`, the manifest and the `python -m nemo_ckpt runs|plot` readers start without Lightning."""
    code = (
        "import sys; from nemo_ckpt import dist_checkpointing; from nemo_ckpt.checkpoint import layout, manifest; "
        "from nemo_ckpt.logger import cli; print(sorted({m.split('.')[0] for m in sys.modules} & {'lightning', "
        "'nemo_run', 'fiddle'}))"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"


@pytest.mark.parametrize("package", ["nemo_ckpt.checkpoint", "nemo_ckpt.logger"])
def test_subpackages_export_their_names_on_first_use(package: str) -> None:
    module = importlib.import_module(package)
    for name in module.__all__:
        assert getattr(module, name).__name__ == name
    with pytest.raises(AttributeError, match=f"module '{package}' has no attribute 'NeMoLoger'"):
        module.NeMoLoger  # noqa: B018
