"""The tiny GPT trained on a GPU: an async checkpoint, staged into pinned memory on a side stream that the next
forward and backward overlap (`ckpt_async_overlap_staging`) while training goes on, holds the values of its save;
resuming with `ckpt_load_directly_on_device` loads it onto the GPU bit-identically, and training continues as in the
uninterrupted run. Skipped without a GPU (see `device_check.sh`).

Each save first holds up the staging stream for a while (`hold_up_staging`), so that a copy ordered too late
against training's next kernels (the optimizer's update; a buffer changed in forward) would find changed values,
and so that whether training's stream went on before the copies were done (they overlap the next forward and
backward) or waited for them (by default, or for a model with GPU buffers) shows at the save."""

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from nemo_ckpt import dist_checkpointing
from nemo_ckpt.dist_checkpointing.strategies.filesystem_async import DeviceToHostCopies
from nemo_ckpt.strategy.state_dict import saves_gpu_buffers
from tests.helpers.trainer import assert_same_checkpoint, fit

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

MAX_STEPS = 6
SAVE_AT = 2
STRATEGY = {"ckpt_async_save": True, "ckpt_assume_constant_structure": True, "ckpt_async_overlap_staging": True}


def copies_pending() -> bool:
    """Once training's stream has done its queued work: whether the staging stream still has copies to do."""
    torch.cuda.current_stream().synchronize()
    return not DeviceToHostCopies._side_stream().query()


def hold_up_staging() -> None:
    """Queue about a second of matrix products on the stream that stages GPU shards into host memory (into memory
    allocated first, as an allocation may wait for queued work)."""
    if not torch.cuda.is_available():
        return
    with torch.cuda.stream(DeviceToHostCopies._side_stream()):
        matrix = torch.full((8192, 8192), 1 / 8192, device="cuda")  # its square is itself
        product = torch.empty_like(matrix)
        for _ in range(20):
            torch.mm(matrix, matrix, out=product)
            torch.mm(product, product, out=matrix)


class SaveAndSnapshot(pl.Callback):
    """At step `step`, save a checkpoint to `path` and keep a copy of the live state as it was at the call. A save
    the step before (to `<path>-warm-up`) allocates the pinned staging memory, which waits for queued work."""

    def __init__(self, step: int, path: Path) -> None:
        self.step = step
        self.path = path
        self.snapshot: dict[str, torch.Tensor] = {}
        self.final: dict[str, torch.Tensor] = {}
        self.copies_pending_after_save: bool | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step - 1:
            trainer.save_checkpoint(self.path.with_name(f"{self.path.name}-warm-up"))
        if trainer.global_step == self.step:
            hold_up_staging()
            trainer.save_checkpoint(self.path)
            self.copies_pending_after_save = torch.cuda.is_available() and copies_pending()
            self.snapshot = self._state(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.final = self._state(trainer, pl_module)

    @staticmethod
    def _state(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, torch.Tensor]:
        """Parameters, buffers and optimizer state on the CPU, under their checkpoint keys; the copies are queued on
        the current stream, so they see what the kernels queued before them wrote."""
        state = {key: value.detach().to("cpu", copy=True) for key, value in pl_module.state_dict().items()}
        names = {param: name for name, param in pl_module.named_parameters()}
        for param, param_state in trainer.optimizers[0].state.items():
            for key, value in param_state.items():
                if torch.is_tensor(value) and value.dim():
                    state[f"optimizer.state.{key}.{names[param]}"] = value.to("cpu", copy=True)
        return state


class CountForwards(pl.Callback):
    """Give the model a buffer that its forward changes (as BatchNorm's statistics are): the number of forwards."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pl_module.register_buffer("forward_count", torch.zeros(1, device=pl_module.device))

        def count(*_: Any) -> None:
            pl_module.forward_count.add_(1)

        pl_module.module.register_forward_pre_hook(count)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[Path, SaveAndSnapshot, list[float]]:
    directory = tmp_path_factory.mktemp("gpu")
    saver = SaveAndSnapshot(SAVE_AT, directory / f"step{SAVE_AT}")
    losses = fit(1, {}, MAX_STEPS, accelerator="gpu", callbacks=[saver], **STRATEGY)
    return directory, saver, losses


def test_async_checkpoint_from_the_gpu_holds_the_values_of_its_save(uninterrupted):
    directory, saver, _ = uninterrupted
    stored = dist_checkpointing.load_plain_tensors(directory / f"step{SAVE_AT}" / "weights")
    assert any(key.startswith("optimizer.state.exp_avg_sq.") for key in saver.snapshot)
    for key, value in saver.snapshot.items():
        assert torch.equal(stored[key], value), key
    changed = [key for key, value in saver.final.items() if not torch.equal(value, saver.snapshot[key])]
    assert changed, "training went on after the save: the checkpoint was written while the live state changed"
    assert saver.copies_pending_after_save, "training's stream went on only once the copies were done"


def test_resume_loads_onto_the_gpu_bit_identically_and_training_continues(uninterrupted, tmp_path):
    directory, _, reference = uninterrupted
    losses = fit(
        1,
        {},
        MAX_STEPS,
        accelerator="gpu",
        ckpt_path=directory / f"step{SAVE_AT}",
        save_at_start=tmp_path / "loaded",
        ckpt_load_directly_on_device=True,
        **STRATEGY,
    )
    assert_same_checkpoint(directory / f"step{SAVE_AT}", tmp_path / "loaded")
    assert losses == pytest.approx(reference[SAVE_AT:], rel=1e-5)


def test_async_checkpoint_holds_gpu_buffers_as_they_were_at_the_save(tmp_path):
    saver = SaveAndSnapshot(SAVE_AT, tmp_path / "step")
    fit(1, {}, MAX_STEPS, accelerator="gpu", callbacks=[CountForwards(), saver], **STRATEGY)
    stored = dist_checkpointing.load_plain_tensors(tmp_path / "step" / "weights")
    assert saver.snapshot["forward_count"].item() == SAVE_AT
    assert saver.final["forward_count"].item() == MAX_STEPS
    assert saver.copies_pending_after_save is False, "with GPU buffers training's stream waits for the copies"
    for key, value in saver.snapshot.items():
        assert torch.equal(stored[key], value), key


def test_buffers_on_the_gpu_count_as_saved_gpu_buffers():
    assert saves_gpu_buffers(torch.nn.BatchNorm1d(4).cuda())
    assert not saves_gpu_buffers(torch.nn.BatchNorm1d(4))
    assert not saves_gpu_buffers(torch.nn.Linear(4, 4).cuda())


def test_by_default_training_waits_for_the_copies_at_the_save(tmp_path):
    saver = SaveAndSnapshot(SAVE_AT, tmp_path / "step")
    fit(1, {}, SAVE_AT + 1, accelerator="gpu", callbacks=[saver], **{**STRATEGY, "ckpt_async_overlap_staging": False})
    stored = dist_checkpointing.load_plain_tensors(tmp_path / "step" / "weights")
    assert saver.copies_pending_after_save is False
    for key, value in saver.snapshot.items():
        assert torch.equal(stored[key], value), key
