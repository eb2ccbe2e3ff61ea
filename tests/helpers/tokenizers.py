"""Tiny tokenizers made locally (nothing downloads), and text that exercises them: non-ASCII letters, CJK, an
emoji, tabs, runs of spaces, and special tokens written as plain text."""

import random
from pathlib import Path

TEXT = "Grüße aus Köln: naïve café, 日本語 🤖!\n\tTabs,  two spaces, <eod> and </s> as text."


def train_sentencepiece(directory: Path, vocab_size: int = 80) -> Path:
    """A SentencePiece BPE model (unk 0, bos 1, eos 2, no pad) trained on words and `TEXT`; return its `.model`."""
    import sentencepiece

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdeéü") for _ in range(5)) for _ in range(100)]
    directory.mkdir(parents=True, exist_ok=True)
    corpus = directory / "corpus.txt"
    corpus.write_text("\n".join([" ".join(rng.sample(words, 8)) for _ in range(200)] + [TEXT] * 5))
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(directory / "sp"),
        vocab_size=vocab_size,
        model_type="bpe",
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=1,
        minloglevel=2,
    )
    return directory / "sp.model"
