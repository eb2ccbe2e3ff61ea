"""NeMo 2.0 checkpoint directories <-> our GPT checkpoints.

A NeMo 2.0 checkpoint (what `llm.pretrain` / `llm.finetune` / `llm.import_ckpt` write) is

    weights/                 torch_dist, Megatron-Core's GPT naming under the `module.` prefix (`megatron.py`)
    context/io.json          Fiddle's JSON of `TrainerContext(model=LlamaModel(config=Llama32Config1B(...),
                             tokenizer=AutoTokenizer("nemo_tokenizer")), trainer=..., extra=...)`
    context/model.yaml       the model's config as YAML, for people (not read here)
    context/nemo_tokenizer/  the Hugging Face tokenizer files (or a SentencePiece `tokenizer.model` in context/)

`import_nemo2` reads `context/io.json` as data: the JSON is walked without importing anything it names; the model
must be one of NeMo's GPT model classes and its config one of the config classes of `nemo2_configs.py`, whose
defaults complete the arguments NeMo stored (it stores only those set). A config field that changes the model and
that our GPT cannot express (LayerNorm, GeLU, biases, learned positions, a sliding window shorter than the
sequence, ...) or that this reader does not know is refused, naming it. Only files inside the checkpoint's folder
are opened. `export_nemo2` writes our checkpoint in that layout: the weights as `export_megatron` does, an
`io.json` naming NeMo's classes with every field that decides the model set explicitly (so it reads the same with
any NeMo version's defaults), `model.yaml`, and the tokenizer under `context/nemo_tokenizer/`.
"""

import json
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from nemo_ckpt import dist_checkpointing
from nemo_ckpt.checkpoint.hf_tokenizer import TOKENIZER_FILES
from nemo_ckpt.checkpoint.layout import context_dir, weights_dir
from nemo_ckpt.models.gpt.convert.hf import export_family, hf_artifact_sources
from nemo_ckpt.models.gpt.convert.megatron import EMBEDDING, detect_prefix, export_megatron, import_megatron
from nemo_ckpt.models.gpt.convert.nemo2_configs import (
    AUTO_TOKENIZER,
    CONFIG_CLASSES,
    LLM,
    MODEL_CLASSES,
    SENTENCEPIECE_TOKENIZER,
    SILU,
    STRING_ARTIFACT,
    TRAINER_CONTEXT,
    PyRef,
    class_defaults,
)
from nemo_ckpt.models.gpt.model import GPTConfig

IO_JSON = "io.json"
MODEL_YAML = "model.yaml"
NEMO_TOKENIZER_DIR = "nemo_tokenizer"
MAX_IO_JSON_BYTES = 16 * 2**20  # a trainer context with its data module is tens of KiB
MAX_DEPTH = 64

# NeMo field -> ours, for the fields that decide the model and that both have.
SAME_NAME_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "seq_length",
    "layernorm_epsilon",
    "init_method_std",
    "share_embeddings_and_output_weights",
    "make_vocab_size_divisible_by",
    "add_qkv_bias",
    "qk_layernorm",
    "calculate_per_token_loss",
    "num_layers_in_first_pipeline_stage",
    "num_layers_in_last_pipeline_stage",
    "num_moe_experts",
    "moe_layer_freq",
    "moe_ffn_hidden_size",
    "moe_router_topk",
    "moe_router_score_function",
    "moe_router_pre_softmax",
    "moe_router_load_balancing_type",
    "moe_aux_loss_coeff",
    "moe_z_loss_coeff",
    "moe_expert_capacity_factor",
    "moe_token_drop_policy",
    "moe_shared_expert_intermediate_size",
)
ROPE_SCALING_FIELDS = {  # Llama31Config's names -> ours
    "scale_factor": "rope_scaling_factor",
    "low_freq_factor": "rope_low_freq_factor",
    "high_freq_factor": "rope_high_freq_factor",
    "old_context_len": "rope_original_max_position_embeddings",
}
# Fields our GPT has one value of: a NeMo model with another value is refused.
FIXED_FIELDS: Mapping[str, Any] = {
    "normalization": "RMSNorm",
    "activation_func": SILU,
    "gated_linear_unit": True,
    "add_bias_linear": False,
    "position_embedding_type": "rope",
    "rotary_percent": 1.0,
    "seq_len_interpolation_factor": None,
    "layernorm_zero_centered_gamma": False,
    "rotary_interleaved": False,
    "multi_latent_attention": False,
    "apply_residual_connection_post_layernorm": False,
    "softmax_scale": None,
    "attention_output_gate": False,
    "moe_router_topk_scaling_factor": None,
    "moe_router_num_groups": None,
    "moe_router_enable_expert_bias": False,
    "moe_shared_expert_gate": False,
}
# Fields read but not carried over: `rotary_base` and `ffn_hidden_size` are converted; `vocab_size` is checked
# against the weights; `window_size` is checked against the sequence.
CONVERTED_FIELDS = ("rotary_base", "ffn_hidden_size", "vocab_size", "window_size")
# Fields that change how a model trains or runs (parallelism, precision, fusions, dropout, recompute, kernels), not
# what it computes: accepted and not carried over.
IGNORED_FIELDS = frozenset(
    {
        "bf16",
        "fp16",
        "params_dtype",
        "pipeline_dtype",
        "autocast_dtype",
        "enable_autocast",
        "parallel_output",
        "sequence_parallel",
        "deallocate_pipeline_outputs",
        "scatter_embedding_sequence_parallel",
        "tp_only_amax_red",
        "use_transformer_engine_full_layer_spec",
        "use_transformer_engine_op_fuser",
        "transformer_layer_spec",
        "forward_step_fn",
        "data_step_fn",
        "generation_config",
        "attention_softmax_in_fp32",
        "apply_query_key_layer_scaling",
        "max_position_embeddings",
        "cp_comm_type",
        "moe_token_dispatcher_type",
        "moe_grouped_gemm",
        "moe_router_dtype",
        "moe_per_layer_logging",
        "use_cpu_initialization",
        "perform_initialization",
        "init_method",
        "output_layer_init_method",
        "deterministic_mode",
        "use_te_rng_tracker",
        "memory_efficient_layer_norm",
        "account_for_embedding_in_pipeline_split",
        "account_for_loss_in_pipeline_split",
        "variable_seq_lengths",
        "batch_p2p_comm",
        "overlap_p2p_comm",
        "defer_embedding_wgrad_compute",
        "wgrad_deferral_limit",
        "barrier_with_L1_time",
        "timers",
        "finalize_model_grads_func",
        "grad_scale_func",
        "no_sync_func",
        "grad_sync_func",
        "param_sync_func",
        "num_microbatches_with_partial_activation_checkpoints",
        "distribute_saved_activations",
        "attention_backend",
        "external_cuda_graph",
        "enable_cuda_graph",
    }
)
_IGNORED_PATTERN = re.compile(
    r".*(_fusion|_fusion_impl|_parallel_size|_parallel_comm_backend|dropout|_overlap|_overlap_cfg)$"
    r"|^(recompute_|tp_comm|fp8|fp4|cuda_graph|cpu_offloading|pipeline_model_parallel|virtual_pipeline)"
)
_ATTR = re.compile(r"Attr\(name='([A-Za-z_]\w*)'\)")
_KEY = re.compile(r"Key\(key='([^'\\]*)'\)")
_FIDDLE_BUILDABLES = {("fiddle._src.config", "Config"), ("fiddle._src.partial", "Partial")}
_SEQUENCES = {("builtins", "list"): list, ("builtins", "tuple"): tuple}


class NeMoContextError(ValueError):
    """A NeMo 2.0 checkpoint's `context/` that does not describe a model this converter reads."""


@dataclass(frozen=True)
class Buildable:
    """A Fiddle `Config` / `Partial` of a NeMo 2.0 `io.json`, read as data: what it names and its arguments."""

    target: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Opaque:
    """Any other Fiddle object of an `io.json` (a custom node type): kept by name, never built."""

    target: str


class _IOJsonReader:
    """Fiddle's JSON read as data into plain values, `PyRef`s, `Buildable`s and `Opaque`s (shared objects read
    once, cycles refused); nothing is imported."""

    def __init__(self, source: Path, raw: Any) -> None:
        if not isinstance(raw, dict) or not isinstance(raw.get("objects"), dict) or "root" not in raw:
            raise NeMoContextError(f"{source} is not Fiddle's JSON of a config (no root and objects)")
        self.source = source
        self.objects: dict[str, Any] = raw["objects"]
        self.read: dict[str, Any] = {}
        self.reading: set[str] = set()
        self.root = raw["root"]

    def value(self, value: Any, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise NeMoContextError(f"{self.source}: objects nested more than {MAX_DEPTH} deep")
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if not isinstance(value, dict):
            raise NeMoContextError(f"{self.source}: a bare JSON {type(value).__name__}, not a Fiddle node")
        kind = value.get("type")
        if kind == "leaf":
            return self.value(value.get("value"), depth + 1)
        if kind == "pyref":
            return PyRef(str(value.get("module")), str(value.get("name")))
        if kind == "ref":
            return self.reference(value.get("key"), depth)
        if isinstance(kind, dict) and kind.get("type") == "pyref":
            return self.object(value, depth)
        raise NeMoContextError(f"{self.source}: a Fiddle node of type {str(kind)[:100]!r}")

    def reference(self, key: Any, depth: int) -> Any:
        if not isinstance(key, str) or key not in self.objects:
            raise NeMoContextError(f"{self.source}: a reference to {str(key)[:100]!r}, not an object of the file")
        if key in self.reading:
            raise NeMoContextError(f"{self.source}: object {key!r} refers to itself (a cycle)")
        if key not in self.read:
            self.reading.add(key)
            self.read[key] = self.value(self.objects[key], depth + 1)
            self.reading.discard(key)
        return self.read[key]

    def object(self, obj: dict[str, Any], depth: int) -> Any:
        symbol = (obj["type"].get("module"), obj["type"].get("name"))
        items = obj.get("items")
        if not isinstance(items, list) or not all(isinstance(item, list) and len(item) == 2 for item in items):
            raise NeMoContextError(f"{self.source}: an object of {symbol} whose items are not [element, value] pairs")
        if symbol in _SEQUENCES:
            return _SEQUENCES[symbol](self.value(item, depth + 1) for _, item in items)
        if symbol == ("builtins", "dict"):
            return {self.name(_KEY, element): self.value(item, depth + 1) for element, item in items}
        if symbol in _FIDDLE_BUILDABLES:
            metadata = self.value(obj.get("metadata"), depth + 1)
            target = metadata.get("fn_or_cls") if isinstance(metadata, dict) else None
            if not isinstance(target, PyRef):
                raise NeMoContextError(f"{self.source}: a Fiddle {symbol[1]} without the callable it builds")
            arguments = {self.name(_ATTR, element): self.value(item, depth + 1) for element, item in items}
            return Buildable(str(target), arguments)
        if symbol == ("fiddle._src.config", "BuildableTraverserMetadata"):
            return {self.name(_ATTR, element): self.value(item, depth + 1) for element, item in items}
        return Opaque(f"{symbol[0]}.{symbol[1]}")

    def name(self, pattern: re.Pattern, element: Any) -> str:
        match = pattern.fullmatch(element) if isinstance(element, str) else None
        if match is None:
            raise NeMoContextError(f"{self.source}: path element {str(element)[:100]!r}, not {pattern.pattern}")
        return match.group(1)


def read_io_json(path: Path) -> Any:
    """The trainer context a NeMo 2.0 `context/io.json` describes, read as data (`Buildable`s of what it names)."""
    size = path.stat().st_size
    if size > MAX_IO_JSON_BYTES:
        raise NeMoContextError(f"{path}: {size} bytes, more than a NeMo context ({MAX_IO_JSON_BYTES})")
    try:
        raw = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as error:
        raise NeMoContextError(f"{path}: not JSON ({type(error).__name__}: {error})") from None
    reader = _IOJsonReader(path, raw)
    return reader.value(reader.root)


@dataclass(frozen=True)
class NeMoModel:
    """What a NeMo 2.0 context says of its model: the model and config classes, the config's fields (defaults
    completed) and the tokenizer files it stores (inside `context/`), if any."""

    model_class: str
    config_class: str
    fields: dict[str, Any]
    tokenizer_files: tuple[Path, ...]


def read_nemo_model(checkpoint: Path) -> NeMoModel:
    """The model of the NeMo 2.0 checkpoint `checkpoint`, from its `context/io.json`."""
    io_json = context_dir(checkpoint) / IO_JSON
    if not io_json.is_file():
        raise FileNotFoundError(f"{checkpoint} is not a NeMo 2.0 checkpoint: {io_json} is missing")
    root = read_io_json(io_json)
    if not isinstance(root, Buildable) or root.target != TRAINER_CONTEXT:
        raise NeMoContextError(f"{io_json}: its root is {_named(root)}, not NeMo's {TRAINER_CONTEXT}")
    model = root.arguments.get("model")
    if not isinstance(model, Buildable) or model.target not in MODEL_CLASSES:
        raise NeMoContextError(
            f"{io_json}: the model is {_named(model)}; this converter reads NeMo's GPT models "
            f"({', '.join(MODEL_CLASSES)})"
        )
    config = model.arguments.get("config")
    if not isinstance(config, Buildable) or config.target not in CONFIG_CLASSES:
        known = ", ".join(name.removeprefix(f"{LLM}.") for name in CONFIG_CLASSES)
        raise NeMoContextError(
            f"{io_json}: model.config is {_named(config)}, which is not one of the NeMo config classes this "
            f"converter knows the defaults of ({known})"
        )
    for name, value in config.arguments.items():
        if isinstance(value, (Buildable, Opaque)) and name not in IGNORED_FIELDS:
            raise NeMoContextError(f"{io_json}: model.config.{name} is {_named(value)}, not a plain value")
    fields = class_defaults(config.target) | config.arguments
    if CONFIG_CLASSES[config.target].rope_scaling:
        fields["rope_scaling"] = True
    tokenizer = _tokenizer_files(checkpoint, model.arguments.get("tokenizer"), io_json)
    return NeMoModel(model.target, config.target, fields, tokenizer)


def _named(value: Any) -> str:
    return f"`{value.target}`" if isinstance(value, (Buildable, Opaque)) else repr(value)[:100]


def _inside_context(checkpoint: Path, relative: Any, io_json: Path, argument: str) -> Path:
    """`relative` (a tokenizer path the context stores), checked to lie inside `checkpoint`'s `context/`."""
    context = context_dir(checkpoint).resolve()
    path = (context / str(relative)).resolve()
    if not isinstance(relative, str) or Path(relative).is_absolute() or not path.is_relative_to(context):
        raise NeMoContextError(
            f"{io_json}: model.tokenizer.{argument}={str(relative)[:200]!r} points outside the checkpoint's context/ "
            "(only files inside the checkpoint are read)"
        )
    return path


def _tokenizer_files(checkpoint: Path, tokenizer: Any, io_json: Path) -> tuple[Path, ...]:
    """The tokenizer files a NeMo context stores: an `AutoTokenizer`'s directory, a `SentencePieceTokenizer`'s model;
    none for no tokenizer or one named by a hub id (NeMo keeps only the name)."""
    if tokenizer is None:
        return ()
    if isinstance(tokenizer, Buildable) and tokenizer.target == AUTO_TOKENIZER:
        name = tokenizer.arguments.get("pretrained_model_name")
        if isinstance(name, Buildable) and name.target == STRING_ARTIFACT:
            return ()
        directory = _inside_context(checkpoint, name, io_json, "pretrained_model_name")
        return tuple(directory / file for file in TOKENIZER_FILES if (directory / file).is_file())
    if isinstance(tokenizer, Buildable) and tokenizer.target == SENTENCEPIECE_TOKENIZER:
        model_path = _inside_context(checkpoint, tokenizer.arguments.get("model_path"), io_json, "model_path")
        return (model_path,) if model_path.is_file() else ()
    raise NeMoContextError(
        f"{io_json}: model.tokenizer is {_named(tokenizer)}; this converter reads {AUTO_TOKENIZER} and "
        f"{SENTENCEPIECE_TOKENIZER}"
    )


def gpt_config_of(nemo: NeMoModel, vocab_size: int, source: Path) -> GPTConfig:
    """Our `GPTConfig` for the NeMo model `nemo` whose embedding has `vocab_size` rows; fields our GPT cannot
    express, or that this converter does not know, raise `NeMoContextError` naming them."""
    fields = nemo.fields
    where = f"{source} ({nemo.config_class.removeprefix(LLM + '.')})"
    known = {*SAME_NAME_FIELDS, *ROPE_SCALING_FIELDS, *FIXED_FIELDS, *CONVERTED_FIELDS, "rope_scaling"}
    unknown = sorted(n for n in fields if n not in known and n not in IGNORED_FIELDS and not _IGNORED_PATTERN.match(n))
    if unknown:
        raise NeMoContextError(
            f"{where}: model.config sets {unknown}, which this converter does not know: it cannot tell whether they "
            "change the model, so it does not import it"
        )
    different = [f"{name}={fields[name]} (ours: {want})" for name, want in FIXED_FIELDS.items() if fields[name] != want]
    window = fields["window_size"]
    if window is not None and (not isinstance(window, (list, tuple)) or window[0] < fields["seq_length"]):
        different.append(f"window_size={window}: a sliding window shorter than seq_length={fields['seq_length']}")
    if fields["vocab_size"] is not None and fields["vocab_size"] != vocab_size:
        different.append(f"vocab_size={fields['vocab_size']}, but the weights' embedding has {vocab_size} rows")
    if different:
        raise NeMoContextError(f"{where}: our GPT cannot express {'; '.join(different)}")
    ours = {name: fields[name] for name in SAME_NAME_FIELDS}
    if fields.get("rope_scaling"):
        ours |= {"rope_scaling": True} | {name: fields[nemo_name] for nemo_name, name in ROPE_SCALING_FIELDS.items()}
    return GPTConfig(
        **ours,
        ffn_hidden_size=fields["ffn_hidden_size"] or 4 * fields["hidden_size"],
        rotary_base=float(fields["rotary_base"]),
        vocab_size=vocab_size,
    )


def import_nemo2(source: str | Path, output: str | Path, overwrite: bool = False) -> Path:
    """Our checkpoint at `output` from the NeMo 2.0 checkpoint directory `source` (`weights/` + `context/`), its
    model config read from `context/io.json` and its tokenizer (if stored) into our `context/hf`."""
    source = Path(source)
    nemo = read_nemo_model(source)
    metadata = dist_checkpointing.load_tensors_metadata(weights_dir(source))
    embedding = metadata[detect_prefix(list(metadata), source) + EMBEDDING]
    config = gpt_config_of(nemo, embedding.global_shape[0], source)
    return import_megatron(source, output, config, overwrite=overwrite, tokenizer_files=nemo.tokenizer_files)


# Our export family -> NeMo's model and config classes.
EXPORT_CLASSES = {
    "llama": (f"{LLM}.llama.LlamaModel", f"{LLM}.llama.LlamaConfig"),
    "qwen2": (f"{LLM}.qwen2.Qwen2Model", f"{LLM}.qwen2.Qwen2Config"),
    "qwen3": (f"{LLM}.qwen3.Qwen3Model", f"{LLM}.qwen3.Qwen3Config"),
    "mixtral": (f"{LLM}.mixtral.MixtralModel", f"{LLM}.mixtral.MixtralConfig"),
}


def nemo_fields(config: GPTConfig) -> dict[str, Any]:
    """NeMo config arguments that give a model equal to ours with `config`, whatever NeMo's class defaults."""
    fields = {name: getattr(config, name) for name in SAME_NAME_FIELDS} | dict(FIXED_FIELDS)
    fields |= {"ffn_hidden_size": config.ffn_hidden_size, "rotary_base": config.rotary_base}
    fields |= {"vocab_size": config.vocab_size, "window_size": None}
    if config.rope_scaling:
        fields |= {nemo_name: getattr(config, name) for nemo_name, name in ROPE_SCALING_FIELDS.items()}
    return fields


class _FiddleJSONWriter:
    """Fiddle's JSON (`serialization.dump_json`'s format) of `Buildable`s naming classes that need not be importable
    here."""

    def __init__(self) -> None:
        self.objects: dict[str, Any] = {}
        self.refcounts: dict[str, int] = {}

    def add(self, prefix: str, obj: dict[str, Any]) -> dict[str, str]:
        key = f"{prefix}_{sum(k.startswith(prefix + '_') for k in self.objects) + 1}"
        self.objects[key], self.refcounts[key] = obj, 1
        return {"type": "ref", "key": key}

    @staticmethod
    def pyref(module: str, name: str) -> dict[str, str]:
        return {"type": "pyref", "module": module, "name": name}

    def value(self, value: Any) -> Any:
        if isinstance(value, Buildable):
            return self.buildable(value)
        if isinstance(value, PyRef):
            return self.pyref(value.module, value.name)
        if isinstance(value, (list, tuple)):
            items = [[f"Index(index={i})", self.value(item)] for i, item in enumerate(value)]
            kind = type(value).__name__
            return self.add(kind, {"type": self.pyref("builtins", kind), "items": items, "metadata": None})
        if isinstance(value, dict):
            items = [[f"Key(key='{key}')", self.value(item)] for key, item in value.items()]
            metadata = {"type": self.pyref("builtins", "tuple"), "items": [], "metadata": None}
            return self.add("dict", {"type": self.pyref("builtins", "dict"), "items": items, "metadata": metadata})
        return {"type": "leaf", "value": value}

    def buildable(self, buildable: Buildable) -> dict[str, str]:
        module, _, name = buildable.target.rpartition(".")
        names = [[f"Index(index={i})", argument] for i, argument in enumerate(buildable.arguments)]
        empty = {"type": self.pyref("builtins", "tuple"), "items": [], "metadata": None}
        no_tags = {"type": self.pyref("builtins", "dict"), "items": [], "metadata": empty}
        metadata_type = self.pyref("fiddle._src.config", "BuildableTraverserMetadata")
        metadata = self.add(
            "buildable_traverser_metadata",
            {
                "type": metadata_type,
                "items": [
                    ["Attr(name='fn_or_cls')", self.pyref(module, name)],
                    ["Attr(name='argument_names')", self.add("tuple", {**empty, "items": names})],
                    ["Attr(name='argument_tags')", self.add("dict", dict(no_tags))],
                    ["Attr(name='argument_history')", self.add("dict", dict(no_tags))],
                ],
                "metadata": metadata_type,
            },
        )
        items = [[f"Attr(name='{key}')", self.value(value)] for key, value in buildable.arguments.items()]
        config = {"type": self.pyref("fiddle._src.config", "Config"), "items": items, "metadata": metadata}
        return self.add(name.lower(), config)

    def dump(self, root: Buildable) -> str:
        reference = self.buildable(root)
        return json.dumps({"root": reference, "objects": self.objects, "refcounts": self.refcounts, "version": "0.0.1"})


def _yaml_value(value: Any) -> Any:
    """NeMo's `model.yaml` form of a value: `_target_` for configs and symbols (nemo_run's YAML serializer)."""
    if isinstance(value, Buildable):
        return {"_target_": value.target} | {key: _yaml_value(item) for key, item in value.arguments.items()}
    if isinstance(value, PyRef):
        return {"_target_": str(value), "_call_": False}
    if isinstance(value, (list, tuple)):
        return [_yaml_value(item) for item in value]
    return value


def nemo_context(config: GPTConfig, has_tokenizer: bool) -> Buildable:
    """The `TrainerContext` a NeMo 2.0 checkpoint of a GPT with `config` stores in `context/io.json`."""
    model_class, config_class = EXPORT_CLASSES[export_family(config).model_type]
    if config.rope_scaling:
        config_class = f"{LLM}.llama.Llama31Config"
    model_arguments: dict[str, Any] = {"config": Buildable(config_class, nemo_fields(config))}
    if has_tokenizer:
        model_arguments["tokenizer"] = Buildable(AUTO_TOKENIZER, {"pretrained_model_name": NEMO_TOKENIZER_DIR})
    trainer = Buildable("nemo.lightning.pytorch.trainer.Trainer", {"devices": 1, "num_nodes": 1})
    return Buildable(TRAINER_CONTEXT, {"model": Buildable(model_class, model_arguments), "trainer": trainer})


def write_nemo_context(checkpoint: Path, config: GPTConfig, source: Path, base: Path | None) -> None:
    """NeMo 2.0's `context/` of a GPT with `config`: `io.json`, `model.yaml` and the tokenizer of `source` (or of
    its adapter base `base`) in `nemo_tokenizer/`."""
    _, tokenizer_dir = hf_artifact_sources(source, base=base)
    context = context_dir(checkpoint)
    context.mkdir(parents=True)
    trainer_context = nemo_context(config, tokenizer_dir is not None)
    (context / IO_JSON).write_text(_FiddleJSONWriter().dump(trainer_context))
    (context / MODEL_YAML).write_text(yaml.safe_dump(_yaml_value(trainer_context.arguments["model"]), sort_keys=False))
    if tokenizer_dir is not None:
        (context / NEMO_TOKENIZER_DIR).mkdir()
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                shutil.copy2(tokenizer_dir / name, context / NEMO_TOKENIZER_DIR / name)


def export_nemo2(
    checkpoint: str | Path,
    output: str | Path,
    overwrite: bool = False,
    read_tensor: Callable[[str], torch.Tensor] | None = None,
    base: str | Path | None = None,
) -> Path:
    """Our GPT checkpoint written as a NeMo 2.0 checkpoint directory at `output`: `weights/` (Megatron-Core naming
    under `module.`), `context/io.json`, `context/model.yaml` and the tokenizer in `context/nemo_tokenizer/`.
    `read_tensor` / `base`: as in `export_megatron` (an adapter checkpoint merged on the way)."""
    return export_megatron(
        checkpoint, output, overwrite=overwrite, read_tensor=read_tensor, base=base, write_context=write_nemo_context
    )
