"""`nemo_ckpt.api.generate`: text from a checkpoint's stored tokenizer, equal to transformers' `generate` decoded;
eos and stop strings end a row; chat templates; streaming; and `nemo nemo_ckpt generate` on the command line."""

import json
from pathlib import Path

import pytest

from nemo_ckpt import api
from nemo_ckpt.checkpoint.context import load_model
from nemo_ckpt.checkpoint.layout import hf_artifacts_dir
from nemo_ckpt.inference.generate import generate_tokens
from nemo_ckpt.inference.sampling import SamplingParams
from nemo_ckpt.inference.text import TextStream
from tests.helpers import commands

transformers = pytest.importorskip("transformers")

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
PROMPTS = ["Hello", "Grüße, how are"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """An imported tiny Llama with a byte-level tokenizer (eos `<eod>`) and a chat template."""
    from tokenizers import Tokenizer

    from nemo_ckpt.checkpoint.hf_tokenizer import byte_level_tokenizer_json
    from nemo_ckpt.models.gpt.convert import import_hf
    from tests.models.test_hf import make_hf_llama

    root = tmp_path_factory.mktemp("generate")
    source = make_hf_llama(root / "hf", vocab_size=257, num_key_value_heads=2)
    backend = Tokenizer.from_str(byte_level_tokenizer_json())
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<eod>", chat_template=CHAT_TEMPLATE
    )
    tokenizer.save_pretrained(source)
    return import_hf(source, root / "ours")


def transformers_text(checkpoint: Path, prompt: str, max_new_tokens: int) -> str:
    hf_dir = checkpoint.parent / "hf"
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def streamed(texts: list[str]) -> str:
    """What streaming prints for `PROMPTS` generating `texts`."""
    return "".join(f"[{row}] {prompt}\n{text}\n" for row, (prompt, text) in enumerate(zip(PROMPTS, texts)))


def test_text_equals_transformers_batched_and_streamed(checkpoint, capsys):
    expected = [transformers_text(checkpoint, prompt, 12) for prompt in PROMPTS]
    assert api.generate(str(checkpoint), PROMPTS, max_new_tokens=12, stream=False) == expected
    assert capsys.readouterr().out == ""
    assert api.generate(str(checkpoint), PROMPTS, max_new_tokens=12) == expected
    assert capsys.readouterr().out == streamed(expected)


def test_stop_strings_cut_the_text(checkpoint):
    full = api.generate(str(checkpoint), PROMPTS[:1], max_new_tokens=12, stream=False)[0]
    stop = full[5:7]
    cut = api.generate(str(checkpoint), PROMPTS[:1], max_new_tokens=12, stop=[stop], stream=False)[0]
    assert cut == full[: full.index(stop)]


def test_stream_holds_back_what_may_start_a_stop_string():
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=_byte_tokenizer(), eos_token="<eod>")
    stream = TextStream(tokenizer, stop_strings=("END",))
    pieces = [stream.push(byte) for byte in b"ab EN"]
    assert "".join(pieces) == "ab " and not stream.stopped
    assert stream.push(ord("D")) == "" and stream.stopped and stream.text == "ab "
    stream = TextStream(tokenizer)
    assert [stream.push(byte) for byte in "ü".encode()] == ["", "ü"]  # a character whole, not its first byte


def _byte_tokenizer():
    from tokenizers import Tokenizer

    from nemo_ckpt.checkpoint.hf_tokenizer import byte_level_tokenizer_json

    return Tokenizer.from_str(byte_level_tokenizer_json())


def test_generation_config_eos_ends_a_row(checkpoint):
    """The end tokens: the tokenizer's eos and the stored generation config's (Llama 3's end-of-turn)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_artifacts_dir(checkpoint))
    prompt = tokenizer(PROMPTS[0]).input_ids
    ids = generate_tokens(load_model(checkpoint), [prompt], SamplingParams(max_new_tokens=12))[0]
    assert tokenizer.eos_token_id not in ids
    config = hf_artifacts_dir(checkpoint) / "generation_config.json"
    original = config.read_text()
    config.write_text(json.dumps({"eos_token_id": [tokenizer.eos_token_id, ids[4]]}))
    try:
        cut = api.generate(str(checkpoint), PROMPTS[:1], max_new_tokens=12, stream=False)[0]
    finally:
        config.write_text(original)
    assert cut == tokenizer.decode(ids[: ids.index(ids[4])])


def test_chat_applies_the_template_and_refuses_without_one(checkpoint, tmp_path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_artifacts_dir(checkpoint))
    chat = api.generate(str(checkpoint), ["Hi"], max_new_tokens=8, chat=True, stream=False)
    plain = api.generate(str(checkpoint), ["<user>Hi<assistant>"], max_new_tokens=8, stream=False)
    assert chat == plain and tokenizer.chat_template == CHAT_TEMPLATE
    (hf_artifacts_dir(checkpoint) / "chat_template.jinja").rename(tmp_path / "template")
    try:
        with pytest.raises(ValueError, match=r"chat=True: the checkpoint's tokenizer has no chat_template"):
            api.generate(str(checkpoint), ["Hi"], chat=True, stream=False)
    finally:
        (tmp_path / "template").rename(hf_artifacts_dir(checkpoint) / "chat_template.jinja")


def test_command_line_streams_and_refuses_unknown_options(checkpoint, tmp_path):
    expected = api.generate(str(checkpoint), PROMPTS, max_new_tokens=6, stream=False)
    args = ("nemo_ckpt", "generate", f"path={checkpoint}", f"prompts={PROMPTS!r}", "max_new_tokens=6")
    result = commands.nemo(*args, cwd=tmp_path)
    assert result.returncode == 0, result.stdout
    assert streamed(expected) in result.stdout
    result = commands.nemo(*args[:4], "max_new_token=6", cwd=tmp_path)
    assert result.returncode != 0 and "No parameter named 'max_new_token'" in result.stdout
