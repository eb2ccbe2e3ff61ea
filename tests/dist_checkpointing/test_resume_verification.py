"""Training resumes only from intact state: a checkpoint ModelCheckpoint saved (its `context/` with checksums
of its own) resumes with the defaults; one byte flipped in its weights stops the resume with a named error before
any step is trained or any checkpoint written from it (the issue's byte trained on and saved again)."""

from pathlib import Path

import pytest

from nemo_ckpt.checkpoint.model_checkpoint import ModelCheckpoint
from nemo_ckpt.dist_checkpointing import cli
from nemo_ckpt.dist_checkpointing.integrity import CHECKSUMS_FNAME
from tests.helpers.distributed import run_distributed
from tests.helpers.trainer import fit


def _train(rank: int, world_size: int, directory: str, resume: str | None, options: dict) -> list[float]:
    checkpoints = ModelCheckpoint(dirpath=directory, monitor=None, every_n_train_steps=2, save_top_k=-1)
    return fit(world_size, {}, 4 if resume else 2, ckpt_path=resume, callbacks=[checkpoints], **options)


@pytest.mark.parametrize("options", [{}, {"ckpt_verify_on_load": True}], ids=["defaults", "verify on"])
def test_a_flipped_byte_stops_the_resume_before_training(tmp_path, options):
    run_distributed(_train, 1, str(tmp_path / "first"), None, options)
    saved = tmp_path / "first" / "epoch=0-step=2"
    assert (saved / "context" / CHECKSUMS_FNAME).is_file() and cli.main(["verify", str(saved)]) == 0
    assert len(run_distributed(_train, 1, str(tmp_path / "intact"), str(saved), options)[0]) == 2  # steps 3, 4
    data = max((saved / "weights").glob("*.distcp"), key=lambda path: path.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x04
    data.write_bytes(raw)
    named = rf"(?s)CorruptCheckpointError.*{data.name} bytes \[\d+, \d+\): checksum mismatch"
    with pytest.raises(Exception, match=named):  # the rank's error, as run_distributed re-raises it
        run_distributed(_train, 1, str(tmp_path / "resumed"), str(saved), options)
    assert not list(Path(tmp_path / "resumed").glob("epoch=*"))
