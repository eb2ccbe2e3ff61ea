"""`CheckpointLM` gives what lm_eval's own Hugging Face backend (`HFLM`) gives on the checkpoint's export, within
1e-4: loglikelihood (with is_greedy), loglikelihood_rolling over several windows, generate_until with stop strings,
and a whole local task through lm_eval's evaluator (nothing downloads)."""

import json
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")  # lm_eval's Hugging Face backend imports it
transformers = pytest.importorskip("transformers")

from lm_eval import evaluator  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from nemo_ckpt.checkpoint.hf_tokenizer import save_tokenizer  # noqa: E402
from nemo_ckpt.data.tokenizer import ByteLevelTokenizer  # noqa: E402
from nemo_ckpt.inference.lm_eval_adapter import CheckpointLM  # noqa: E402
from nemo_ckpt.models.gpt.convert import export_hf, import_hf  # noqa: E402

MAX_LENGTH = 48  # the tiny Llama's max_position_embeddings: both backends' default max_length
PAIRS = [
    ("The capital of France is", " Paris"),
    ("", "An empty context starts at the prefix token"),
    ("Trailing spaces move to the continuation:  ", "yes"),
    ("A context longer than the model's window is cut from the left, " * 2, " so only its end is seen."),
    ("Grüße aus Köln", ", naïve café 🤖"),
]
TEXTS = ["short", "A text of several windows: " + "the quick brown fox jumps over the lazy dog. " * 3]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[CheckpointLM, HFLM]:
    """A tiny random Llama over byte-level ids, imported with its vocabulary padded (257 -> 320 rows) and exported
    back; our adapter on the checkpoint, lm_eval's Hugging Face backend on the export."""
    directory = tmp_path_factory.mktemp("lm_eval")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=257,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_LENGTH,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(directory / "hf")
    save_tokenizer(ByteLevelTokenizer(), directory / "hf")
    checkpoint = import_hf(directory / "hf", directory / "ckpt", make_vocab_size_divisible_by=64)
    exported = export_hf(checkpoint, directory / "export")
    ours = CheckpointLM(str(checkpoint), batch_size=3)
    assert ours.model.config.vocab_size == 320 and ours.vocab_size == 257  # scored over the export's vocabulary
    theirs = HFLM(pretrained=str(exported), backend="causal", device="cpu", batch_size=3, dtype="float32")
    assert theirs.max_length == ours.max_length == MAX_LENGTH
    return ours, theirs


def requests(kind: str, arguments: list[tuple]) -> list[Instance]:
    return [Instance(kind, doc={}, arguments=args, idx=i) for i, args in enumerate(arguments)]


def test_loglikelihood_equals_lm_evals_hugging_face_backend(models):
    ours, theirs = models
    ours_results = ours.loglikelihood(requests("loglikelihood", PAIRS))
    theirs_results = theirs.loglikelihood(requests("loglikelihood", PAIRS), disable_tqdm=True)
    assert len(ours_results) == len(PAIRS)
    for (logprob, greedy), (expected, expected_greedy) in zip(ours_results, theirs_results):
        assert logprob == pytest.approx(expected, abs=1e-4) and logprob < 0
        assert greedy == expected_greedy
    # is_greedy: a context's greedy next token is greedy; the random model's is a lone UTF-8 continuation byte,
    # which no text encodes to, so it is asked for by id
    ids = ours.tok_encode("The capital of France is")
    with torch.no_grad():
        greedy_id = int(ours.model(torch.tensor([ids]))[0, -1, : ours.vocab_size].argmax())
    scored = ours.score([(ids, [greedy_id]), (ids, [(greedy_id + 1) % 256])])
    assert [greedy for _, greedy in scored] == [True, False] and scored[0][0] > scored[1][0]


def test_loglikelihood_rolling_equals_lm_evals_hugging_face_backend(models):
    ours, theirs = models
    assert len(ours.tok_encode(TEXTS[1])) > 2 * MAX_LENGTH  # three windows
    arguments = [(text,) for text in TEXTS]
    ours_results = ours.loglikelihood_rolling(requests("loglikelihood_rolling", arguments))
    theirs_results = theirs.loglikelihood_rolling(requests("loglikelihood_rolling", arguments), disable_tqdm=True)
    assert ours_results == pytest.approx(theirs_results, abs=1e-4)


def test_generate_until_equals_lm_evals_hugging_face_backend(models):
    ours, theirs = models
    contexts = ["Once upon a time", "Q: 2 + 2 =", "x"]
    free = [(context, {"until": [], "max_gen_toks": 12}) for context in contexts]
    texts = ours.generate_until(requests("generate_until", free))
    assert texts == theirs.generate_until(requests("generate_until", free), disable_tqdm=True)
    assert all(texts)
    # stop strings the greedy texts hold: each is cut before its first one
    stops = [text[len(text) // 2] for text in texts]
    stopped = [(context, {"until": [stop], "max_gen_toks": 12}) for context, stop in zip(contexts, stops)]
    cut = ours.generate_until(requests("generate_until", stopped))
    assert cut == theirs.generate_until(requests("generate_until", stopped), disable_tqdm=True)
    assert all(text.startswith(piece) and stop not in piece for text, piece, stop in zip(texts, cut, stops))


def test_a_local_task_through_lm_evals_evaluator(models, tmp_path, monkeypatch):
    """A multiple-choice task from a local JSONL file: per-sample loglikelihoods and the accuracy agree."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    records = [
        {"question": f"What is {a} + {b}?", "choices": [str(a + b), str(a * b + 1), str(a - b - 1)], "label": 0}
        for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]
    ]
    data = tmp_path / "arith.jsonl"
    data.write_text("".join(json.dumps(record) + "\n" for record in records))
    task = {
        "task": "local_arith",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_target": "{{label}}",
        "doc_to_choice": "{{choices}}",
        "metric_list": [{"metric": "acc"}],
    }
    tasks = TaskManager(include_defaults=False)  # lm_eval's own tasks are not indexed (about 40 s)
    # simple_evaluate without its set-up (model construction, seeds, and the environment report, which runs pip)
    results = [evaluator.evaluate(model, tasks.load([task]), bootstrap_iters=0, verbosity="ERROR") for model in models]
    ours, theirs = ([sample["resps"] for sample in result["samples"]["local_arith"]] for result in results)
    assert len(ours) == len(records)
    for our_choices, their_choices in zip(ours, theirs):
        for [(logprob, _)], [(expected, _)] in zip(our_choices, their_choices):
            assert float(logprob) == pytest.approx(float(expected), abs=1e-4)
    accuracy = [result["results"]["local_arith"]["acc,none"] for result in results]
    assert accuracy[0] == accuracy[1]


def test_refuses_a_window_longer_than_the_model(models):
    checkpoint = Path(models[0].tokenizer.name_or_path).parents[1]  # <checkpoint>/context/hf
    with pytest.raises(ValueError, match="max_length=49 exceeds the model's seq_length=48"):
        CheckpointLM(str(checkpoint), max_length=MAX_LENGTH + 1)
