"""The package's public surface: `from nemo_ckpt import ...` names, imported lazily."""

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


def test_dist_checkpointing_alone_does_not_load_lightning():
    code = "import sys; from nemo_ckpt import dist_checkpointing; print('lightning' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"
