"""Train the sample models' ByteLevel BPE tokenizer on the corpus from ``build_corpus.py``.

2,048 tokens (``<pad>``, ``<s>``, ``</s>`` first, then the 256 byte symbols, then merges), trained on
the ``train.txt`` of every domain, each domain repeated so that all weigh about the same. Saved as a
``PreTrainedTokenizerFast`` (pad/bos/eos set) with ``save_pretrained``; deterministic. Reports
bytes/token on each domain's ``eval.txt``.

    python scripts/samples/train_tokenizer.py [--corpus build/corpus] [--out build/tokenizer]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

REPO = Path(__file__).resolve().parents[2]
DOMAINS = ("english", "python", "bible_en", "bible_es", "data")
VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]
PIECE_BYTES = 16_384  # training text is fed in pieces cut at line ends (keeps newline/indent tokens)
EXAMPLE_WORDS = (" the", " and", " que", " self", " def", " return", " Jehová", " Yahweh", " import", '": ')


def pieces(text: str, size: int = PIECE_BYTES) -> Iterator[str]:
    """``text`` in pieces of about ``size`` characters, each ending at a newline."""
    start = 0
    while start < len(text):
        end = text.find("\n", start + size)
        end = len(text) if end == -1 else end + 1
        yield text[start:end]
        start = end


def training_texts(corpus: Path) -> tuple[list[str], dict[str, int]]:
    """Every domain's train text, repeated ``round(largest / size)`` times; and the repeat counts."""
    texts = {name: (corpus / name / "train.txt").read_text(encoding="utf-8") for name in DOMAINS}
    largest = max(len(t) for t in texts.values())
    repeats = {name: max(1, round(largest / max(1, len(t)))) for name, t in texts.items()}
    return [piece for name in DOMAINS for _ in range(repeats[name]) for piece in pieces(texts[name])], repeats


def train(corpus: Path, vocab_size: int = VOCAB_SIZE) -> tuple[PreTrainedTokenizerFast, dict[str, int]]:
    """A ByteLevel BPE trained on the corpus's train splits, wrapped for transformers."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts, repeats = training_texts(corpus)
    tokenizer.train_from_iterator(texts, trainer, length=len(texts))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    return fast, repeats


def bytes_per_token(tokenizer: PreTrainedTokenizerFast, corpus: Path) -> dict[str, float]:
    """UTF-8 bytes per token of each domain's eval slice."""
    result = {}
    for name in DOMAINS:
        text = (corpus / name / "eval.txt").read_text(encoding="utf-8")
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        result[name] = len(text.encode()) / max(1, len(ids))
    return result


def report(tokenizer: PreTrainedTokenizerFast, corpus: Path) -> None:
    """Print bytes/token per domain and how some common words are split."""
    for name, value in bytes_per_token(tokenizer, corpus).items():
        print(f"  {name:9s} {value:.2f} bytes/token on eval.txt")
    vocab = tokenizer.get_vocab()
    for word in EXAMPLE_WORDS:
        ids = tokenizer(word, add_special_tokens=False)["input_ids"]
        pieces_ = tokenizer.convert_ids_to_tokens(ids)
        whole = "single token" if len(ids) == 1 else f"{len(ids)} tokens"
        print(f"  {word!r:11s} -> {pieces_} ({whole}{', id ' + str(ids[0]) if len(ids) == 1 else ''})")
    print(f"  vocab size {len(vocab)}; longest tokens: {sorted(vocab, key=lambda t: (-len(t), t))[:5]}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--corpus", type=Path, default=REPO / "build" / "corpus", help="build_corpus.py output"
    )
    parser.add_argument("--out", type=Path, default=REPO / "build" / "tokenizer", help="output folder")
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    tokenizer, repeats = train(args.corpus, args.vocab_size)
    elapsed = time.perf_counter() - start
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(args.out)
    print(
        f"trained {len(tokenizer)} tokens in {elapsed:.1f} s (domain repeats {repeats}); saved to {args.out}"
    )
    report(tokenizer, args.corpus)


if __name__ == "__main__":
    main()
