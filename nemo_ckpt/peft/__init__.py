"""Parameter-efficient fine-tuning: LoRA adapters (`lora`) and folding them into full checkpoints (`merge`)."""

from nemo_ckpt.peft.lora import LoRA, LoRALinear

__all__ = ["LoRA", "LoRALinear"]
