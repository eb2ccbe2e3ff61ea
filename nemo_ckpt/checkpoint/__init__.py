"""The life of checkpoint directories: where things are (`layout`), the manifest, `ModelCheckpoint` (save, commit,
retain, recover), `AutoResume`, the stored configs (`context`), RNG states and Slurm preemption."""

from nemo_ckpt.checkpoint.context import IOMixin, load_context, load_model
from nemo_ckpt.checkpoint.model_checkpoint import ModelCheckpoint
from nemo_ckpt.checkpoint.preemption import PreemptionCallback
from nemo_ckpt.checkpoint.resume import AutoResume
from nemo_ckpt.checkpoint.rng import RNGStateCallback

__all__ = [
    "AutoResume",
    "IOMixin",
    "ModelCheckpoint",
    "PreemptionCallback",
    "RNGStateCallback",
    "load_context",
    "load_model",
]
