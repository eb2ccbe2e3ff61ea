"""Generation on 2 processes: a LoRA checkpoint loaded split by tensor parallelism (TP=2) generates the
single-process greedy tokens, a checkpoint split into 2 pipeline stages (PP=2) the single-process sampled ones
(same seed); each rank reads its part of the checkpoint."""

import torch

from nemo_ckpt.checkpoint.context import load_model
from nemo_ckpt.inference.generate import generate_tokens
from nemo_ckpt.inference.parallel import load_parallel_model
from nemo_ckpt.inference.sampling import SamplingParams
from tests.helpers.distributed import run_distributed
from tests.inference.test_generate_lora import make_lora_checkpoints

PROMPTS = [[3, 4, 5, 6, 7], [8, 9]]
PARAMS = SamplingParams(max_new_tokens=12)
SAMPLED = SamplingParams(max_new_tokens=12, temperature=1.0, top_k=20, seed=3)


def generate_split(rank: int, world_size: int, base: str, adapters: str) -> dict[str, list[list[int]]]:
    torch.set_num_threads(1)
    tp = load_parallel_model(adapters, tensor_parallel_size=2)
    pp = load_parallel_model(base, pipeline_parallel_size=2)
    return {"tp-lora": generate_tokens(tp, PROMPTS, PARAMS), "pp": generate_tokens(pp, PROMPTS, SAMPLED)}


def test_tensor_and_pipeline_parallel_generation_equals_one_process(tmp_path):
    base, adapters = make_lora_checkpoints(tmp_path)
    expected = {
        "tp-lora": generate_tokens(load_model(adapters), PROMPTS, PARAMS),
        "pp": generate_tokens(load_model(base), PROMPTS, SAMPLED),
    }
    for ranks in run_distributed(generate_split, 2, str(base), str(adapters)):
        assert ranks == expected
