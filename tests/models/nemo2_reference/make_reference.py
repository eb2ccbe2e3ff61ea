"""How `context/` here was made: by NeMo 2.0's own code (nemo-toolkit 2.5.3, `IOMixin.io_dump`, as a NeMo checkpoint
stores its context), for `tests/models/test_nemo2.py`.

    python3 -m venv /tmp/nemo-venv && /tmp/nemo-venv/bin/pip install torch==2.13.0 nemo_toolkit==2.5.3 lightning \
        rich hydra-core fiddle einops "transformers<4.57" sentencepiece "datasets<4.4" "huggingface_hub<1" \
        nemo-run==0.11.1 leptonai==0.27.3 tiktoken tensorstore
    /tmp/nemo-venv/bin/pip install --no-deps megatron-core==0.14.0
    PYTHONPATH=<stubs> /tmp/nemo-venv/bin/python make_reference.py <tokenizer dir> <output>

`<stubs>` holds empty stand-ins of `nv_one_logger` (NVIDIA's telemetry, not on PyPI, imported by
`nemo.lightning` and unused here); `<tokenizer dir>` is `save_tokenizer(ByteLevelTokenizer(), "tok")`
(`nemo_ckpt.checkpoint.hf_tokenizer`). Transformer Engine is not installed, so the config sets
`apply_rope_fusion=False`.
"""

import sys
from pathlib import Path

import nemo.lightning as nl
import torch
from nemo.collections import llm
from nemo.collections.common.tokenizers.huggingface.auto_tokenizer import AutoTokenizer
from nemo.lightning.io.pl import TrainerContext

tokenizer_dir, output = sys.argv[1], Path(sys.argv[2])
config = llm.Llama32Config1B(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=128,
    seq_length=64,
    params_dtype=torch.bfloat16,
    bf16=True,
    apply_rope_fusion=False,
)
model = llm.LlamaModel(config, tokenizer=AutoTokenizer(pretrained_model_name=tokenizer_dir))
strategy = nl.MegatronStrategy(tensor_model_parallel_size=1, ckpt_async_save=True)
trainer = nl.Trainer(devices=1, accelerator="cpu", strategy=strategy, max_steps=10)
TrainerContext(model, trainer, extra={}).io_dump(output / "context", yaml_attrs=["model"])
