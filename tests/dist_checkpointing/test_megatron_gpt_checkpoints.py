"""A GPT checkpoint with its distributed optimizer's Adam state, exchanged with every installed megatron-core
version in both directions across world sizes (tensor-parallel 2 -> 1): megatron-core's, saved on 4 ranks, loads here
on 2 and 1; ours, saved on 4, loads in megatron-core on 2 (each megatron-core run is a torchrun of fresh processes).

megatron-core writes the optimizer format it uses by default: 0.15.3 `fully_sharded_model_space` (flattened
ranges of the dp ranks, stored in its reformulated layout), 0.19.2 `fully_reshardable` (model space). Our
checkpoints hold optimizer state in model space, which both read. A flattened-range state saved with our library
(as megatron-core 0.15's distributed optimizer hands it over) is stored in that reformulated layout with its
`mcore_data`, which megatron-core 0.15 requires to read flattened templates: it loads there at another world size,
and here at every world size. See megatron_gpt_state.py.
"""

from pathlib import Path

import pytest

from tests.dist_checkpointing.megatron_gpt_state import ours
from tests.helpers.distributed import run_distributed
from tests.helpers.megatron import megatron_core_sites, torchrun

WORKER = Path(__file__).with_name("megatron_gpt_state.py")
SITES = megatron_core_sites()
MEGATRON_FORMAT = {"0.15.3": "flat", "0.19.2": "model_space"}
VERSIONS = [pytest.param(version, id=f"megatron-core-{version}") for version in MEGATRON_FORMAT]


def site(version: str) -> Path:
    if version not in SITES:
        pytest.skip(f"megatron-core {version} is not installed: run tests/install_megatron_core.sh")
    return SITES[version]


@pytest.fixture(scope="module")
def our_checkpoint(tmp_path_factory) -> Path:
    checkpoint = tmp_path_factory.mktemp("ours")
    run_distributed(ours, 4, "save", str(checkpoint), "model_space")
    return checkpoint


@pytest.mark.parametrize("version", VERSIONS)
def test_megatron_checkpoint_loads_here_at_other_world_sizes(version, tmp_path):
    torchrun(4, WORKER, "megatron", "save", str(tmp_path), MEGATRON_FORMAT[version], site=site(version))
    for world_size in (2, 1):
        assert min(run_distributed(ours, world_size, "load", str(tmp_path), MEGATRON_FORMAT[version])) > 0


@pytest.mark.parametrize("version", VERSIONS)
def test_our_checkpoint_loads_in_megatron_at_another_world_size(version, our_checkpoint):
    output = torchrun(2, WORKER, "megatron", "load", str(our_checkpoint), "model_space", site=site(version))
    assert output.stdout.count("tensors equal") == 2, output.stdout


@pytest.fixture(scope="module")
def our_flat_checkpoint(tmp_path_factory) -> Path:
    checkpoint = tmp_path_factory.mktemp("ours-flat")
    run_distributed(ours, 4, "save", str(checkpoint), "flat")
    return checkpoint


def test_our_flat_checkpoint_loads_in_megatron_core_0_15_and_here_at_other_world_sizes(our_flat_checkpoint):
    output = torchrun(2, WORKER, "megatron", "load", str(our_flat_checkpoint), "flat", site=site("0.15.3"))
    assert output.stdout.count("tensors equal") == 2, output.stdout
    for world_size in (2, 1):
        assert min(run_distributed(ours, world_size, "load", str(our_flat_checkpoint), "flat")) > 0
