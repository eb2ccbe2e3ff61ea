"""`AutoResume`: pick the checkpoint a run continues from, like NeMo's `nl.AutoResume`."""

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import fiddle as fdl
import lightning.pytorch as pl
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from nemo_ckpt import dist_checkpointing
from nemo_ckpt.checkpoint import context
from nemo_ckpt.checkpoint.layout import (
    MANIFEST_NAME,
    completion_marker,
    hf_artifacts_dir,
    is_complete,
    weights_dir,
)
from nemo_ckpt.checkpoint.manifest import Manifest
from nemo_ckpt.dist_checkpointing import ShardedTensor
from nemo_ckpt.dist_checkpointing.dtensor import dtensor_to_sharded_tensor, local_tensor

log = logging.getLogger(__name__)


@dataclass
class RestoreConfig:
    """The checkpoint a fine-tuning run starts from, like NeMo's `nl.RestoreConfig`: its model weights (an
    imported Hugging Face model or another run's checkpoint, any layout), with a fresh optimizer at step 0.

    `load_optim_state=True` is refused: a run that continues another run's optimizer resumes it
    (`AutoResume(resume_from_path=...)`). With `load_artifacts`, the tokenizer stored with the checkpoint (an
    imported model's `context/hf`) replaces the data module's, as NeMo restores the model's tokenizer from the
    checkpoint's context (`restore_artifacts`).
    """

    path: str
    load_model_state: bool = True
    load_optim_state: bool = False
    load_artifacts: bool = True

    def __post_init__(self) -> None:
        if self.load_optim_state:
            raise ValueError(
                "RestoreConfig(load_optim_state=True) is not supported: a restored run starts a fresh optimizer; "
                "to continue a run with its optimizer state use AutoResume(resume_from_path=...)"
            )

    def check(self) -> Path:
        """The checkpoint to restore from; raise if it is not a complete checkpoint."""
        path = Path(self.path)
        if not is_complete(path):
            raise FileNotFoundError(
                f"RestoreConfig(path={self.path!r}) is not a complete checkpoint: {completion_marker(path)} is "
                "missing (import a Hugging Face model with nemo_ckpt.api.import_ckpt first)"
            )
        return path

    def tokenizer_dir(self) -> Path | None:
        """The tokenizer stored with the checkpoint (`context/hf` with `tokenizer.json` or `tokenizer_config.json`),
        or None if it stores none."""
        artifacts = hf_artifacts_dir(self.path)
        if any((artifacts / name).is_file() for name in TOKENIZER_FILES):
            return artifacts
        return None


@dataclass
class AutoResume:
    """Where a run resumes from.

    `resume_from_path` (a checkpoint) wins. Else, with `resume_if_exists`, the newest complete checkpoint that
    holds optimizer state in `resume_from_directory` (default: the run's checkpoint directory), found through
    its `checkpoints.json`: unfinished and incomplete checkpoints are skipped with a warning. Without one, the
    run fails unless `resume_ignore_no_checkpoint`. With `restore_config`, the model is rebuilt from the config
    stored in the checkpoint instead of the one the run was given; that config is read as data, building only the
    classes of `nemo_ckpt.checkpoint.registry` (`nemo_ckpt.checkpoint.context`), unless `restore_config_trust_code`.
    With a `RestoreConfig` instead, a run that finds nothing to resume starts from that checkpoint's weights
    (fine-tuning); a run that resumes takes its weights from the resumed checkpoint.
    """

    resume_if_exists: bool = False
    resume_ignore_no_checkpoint: bool = False
    resume_from_path: str | None = None
    resume_from_directory: str | None = None
    restore_config: bool | RestoreConfig = False
    restore_config_trust_code: bool = False

    def find_checkpoint(
        self, checkpoint_dir: str | Path | None, load_optimizer: bool = True, writes_checkpoints: bool = False
    ) -> Path | None:
        """The checkpoint to resume from, or None to start from scratch.

        `load_optimizer=False` (`MegatronStrategy(ckpt_load_optimizer=False)`): checkpoints without optimizer state
        resume too (their weights, with a fresh optimizer). `writes_checkpoints`: the run saves into
        `checkpoint_dir`, so starting from scratch there is refused while it holds another run's checkpoints (its
        saves would mix with them), before any process starts.
        """
        if self.resume_from_path:
            path = Path(self.resume_from_path)
            if not is_complete(path):
                raise FileNotFoundError(
                    f"AutoResume(resume_from_path={str(path)!r}) is not a complete checkpoint: "
                    f"{completion_marker(path)} is missing"
                )
            return path
        directory = (
            Path(self.resume_from_directory or checkpoint_dir) if self.resume_from_directory or checkpoint_dir else None
        )
        if not self.resume_if_exists:
            if writes_checkpoints and directory is not None:
                _refuse_earlier_run(directory, "AutoResume(resume_if_exists=False)", "set resume.resume_if_exists=True")
            return None
        if directory is None:
            raise ValueError(
                "AutoResume(resume_if_exists=True) needs resume_from_directory or the run's checkpoint directory"
            )
        checkpoint = newest_resumable(directory, load_optimizer)
        if checkpoint is not None:
            log.info("AutoResume: resuming from %s", checkpoint)
            return checkpoint
        if writes_checkpoints or not self.resume_ignore_no_checkpoint:
            _refuse_earlier_run(
                directory,
                "AutoResume(resume_if_exists=True) found none it can resume",
                "set trainer.strategy.ckpt_load_optimizer=False to continue from the newest one's weights with a fresh "
                "optimizer",
            )
        if self.resume_ignore_no_checkpoint:
            log.info("AutoResume: no checkpoint to resume from in %s; starting from scratch", directory)
            return None
        hint = ""
        if (
            directory.is_dir()
            and not (directory / MANIFEST_NAME).exists()
            and any(is_complete(entry) for entry in directory.iterdir())
        ):
            hint = f" ({MANIFEST_NAME} is missing: pass one of its checkpoints as resume_from_path)"
        raise FileNotFoundError(
            f"AutoResume(resume_if_exists=True) found no complete checkpoint in {directory}{hint}; "
            "set resume_ignore_no_checkpoint=True to start from scratch"
        )

    def restore_model(self, checkpoint: Path | None, model: pl.LightningModule) -> pl.LightningModule:
        """With `restore_config` and a checkpoint, the model rebuilt from the checkpoint's config; else `model`."""
        if self.restore_config is not True or checkpoint is None:
            return model
        config = context.load_model_config(checkpoint, trust_code=self.restore_config_trust_code)
        if isinstance(model, context.IOMixin) and model.__io__ != config:
            log.warning(
                "AutoResume(restore_config=True): using the model config of %s, not the one given:\n%s",
                checkpoint,
                config,
            )
        return fdl.build(config)


def newest_resumable(directory: Path, load_optimizer: bool = True) -> Path | None:
    """The newest complete checkpoint in `directory` that a run can resume (from its manifest): with
    `load_optimizer`, only those holding optimizer state; the ones skipped are named at WARNING with the reason."""
    for record in reversed(Manifest.read(directory).checkpoints):
        path = directory / record.name
        if record.state == "deleting":
            continue
        if not is_complete(path):
            log.warning(
                "AutoResume: skipping %s: %s",
                path,
                "its save did not finish" if record.state == "saving" else "it is missing or incomplete",
            )
        elif record.weights_only and load_optimizer:
            log.warning(
                "AutoResume: skipping %s: it holds no optimizer state (saved at the end of training with "
                "ModelCheckpoint(save_optim_on_train_end=False)); trainer.strategy.ckpt_load_optimizer=False resumes "
                "its weights with a fresh optimizer",
                path,
            )
        else:
            return path
    return None


def _refuse_earlier_run(directory: Path, situation: str, fix: str) -> None:
    """Raise if `directory` holds complete checkpoints of an earlier run, which a run starting from scratch there
    would mix its own checkpoints with (and whose top-k would delete them)."""
    complete = Manifest.read(directory).complete() if directory.is_dir() else []
    if complete:
        kinds = "without optimizer state" if all(record.weights_only for record in complete) else "of an earlier run"
        raise FileExistsError(
            f"{directory} holds {len(complete)} checkpoints {kinds} (newest: {complete[-1].name}) and {situation}: "
            f"{fix}; or choose another log directory or name (log.log_dir, log.name), or remove them"
        )


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def restore_artifacts(config: RestoreConfig, data: pl.LightningDataModule) -> None:
    """With `config.load_artifacts`, make `data` (a module with a `tokenizer_path`, e.g. `FineTuningDataModule`)
    tokenize with the tokenizer stored in the restored checkpoint; a different tokenizer it names is replaced,
    with a warning (set `load_artifacts=False` to keep it). Raises if neither names a tokenizer."""
    if not config.load_artifacts or not hasattr(data, "tokenizer_path"):
        return
    stored = config.tokenizer_dir()
    if stored is None:
        if data.tokenizer_path is None:
            raise ValueError(
                f"RestoreConfig(path={config.path!r}, load_artifacts=True): {hf_artifacts_dir(config.path)} holds no "
                f"tokenizer ({' or '.join(TOKENIZER_FILES)}) and {type(data).__name__}(tokenizer=None) names none: "
                "pass tokenizer= to the data module"
            )
        log.info("RestoreConfig: %s stores no tokenizer; using %s", config.path, data.tokenizer_path)
        return
    if data.tokenizer_path is not None and Path(data.tokenizer_path).resolve() != stored.resolve():
        log.warning(
            "RestoreConfig(load_artifacts=True): tokenizing with the tokenizer stored in %s, not %s (set "
            "load_artifacts=False to keep the data module's)",
            stored,
            data.tokenizer_path,
        )
    data.tokenizer_path = str(stored)


class RestoreCallback(pl.Callback):
    """Load a `RestoreConfig`'s model weights into the model once the strategy has built and sharded it.

    Keys are matched by name and loaded whatever layout saved them (one tensor or DTensor shards). When the run
    resumes a checkpoint of its own (`resuming`), nothing is loaded, unless the model trains adapters (`peft`):
    their checkpoints hold only the adapters, so the base weights always come from the restore checkpoint.
    """

    def __init__(self, config: RestoreConfig, resuming: bool = False) -> None:
        self.config = config
        self.resuming = resuming

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        peft = getattr(pl_module, "peft", None)
        if not self.config.load_model_state or (self.resuming and peft is None):
            return
        load_restore_weights(pl_module, self.config.check(), None if peft is None else peft.is_adapter_key)


@torch.no_grad()
def load_restore_weights(
    module: nn.Module, checkpoint: Path, may_be_missing: Callable[[str], bool] | None = None
) -> None:
    """Load `checkpoint`'s weights into `module`'s parameters and buffers (plain tensors or DTensor shards).

    Every tensor of the module must be in the checkpoint with its shape, except keys `may_be_missing(key)` accepts
    (adapters); a mismatch raises before anything is loaded, naming the keys.
    """
    weights = weights_dir(checkpoint)
    stored = dist_checkpointing.load_tensors_metadata(weights)
    live = nn.Module.state_dict(module)  # every tensor, whatever the module's own `state_dict` saves
    missing = [key for key in live if key not in stored and not (may_be_missing and may_be_missing(key))]
    mismatched = [
        f"{key}: {list(stored[key].global_shape)} in the checkpoint, {list(tensor.shape)} here"
        for key, tensor in live.items()
        if key in stored and tuple(stored[key].global_shape) != tuple(tensor.shape)
    ]
    if missing or mismatched:
        raise ValueError(
            f"RestoreConfig(path={str(checkpoint)!r}) holds another architecture than the model: "
            f"missing {missing[:8]}, shapes differ for {mismatched[:8]}"
        )
    template = {}
    for key, tensor in live.items():
        if key not in stored or local_tensor(tensor).numel() == 0:
            continue
        if isinstance(tensor, DTensor):
            template[key] = dtensor_to_sharded_tensor(key, tensor)
        else:
            template[key] = ShardedTensor.from_rank_offsets(key, tensor.detach(), replica_id=0)
        if template[key].dtype != stored[key].dtype:  # e.g. a bf16 import into fp32 parameters: read, then cast
            buffer = torch.empty_like(template[key].data, dtype=stored[key].dtype)
            template[key] = replace(template[key], data=buffer, dtype=buffer.dtype)
    loaded = dist_checkpointing.load(template, weights, validate_access_integrity=False)
    for key in template:
        target = local_tensor(live[key])
        if target.data_ptr() != loaded[key].data_ptr():
            target.copy_(loaded[key])
    log.info("Restored %d tensors from %s", len(template), checkpoint)
