"""Train a byte-level BPE tokenizer of your own with Hugging Face's `tokenizers` library (installed with shardkit).

    python examples/train_tokenizer.py data/alice.txt --vocab 512 --out data/alice-bpe.json

Byte-level: every byte is in the starting alphabet, so any text encodes, nothing is unknown. The tokenizer's vocab is
its `--vocab` (the 256 byte symbols, the end-of-document token `</s>` and the merges learned from the text, up to that
count); the model trained on its tokens needs `model.vocab` at least that large (docs/tutorials/own-text.md).
tests/test_examples.py runs this file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

END_OF_DOCUMENT = "</s>"  # `shardkit data prepare` appends it after every document (its --eos default)
SMALLEST_VOCAB = 256 + 1  # the byte symbols and END_OF_DOCUMENT; below it the trainer would widen --vocab silently


def train_tokenizer(texts: list[str], vocab: int) -> Tokenizer:
    """A byte-level BPE tokenizer of `vocab` tokens learned from the files `texts`."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[END_OF_DOCUMENT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train(texts, trainer)
    return tokenizer


def input_refusal(texts: list[str], vocab: int) -> str | None:
    """What is wrong with the command line, in one line, or None."""
    missing = [text for text in texts if not Path(text).is_file()]
    if missing:
        return f"texts: no such file {missing[0]}"
    if vocab < SMALLEST_VOCAB:
        return f"--vocab: must be at least {SMALLEST_VOCAB} (the 256 bytes and {END_OF_DOCUMENT}), got {vocab}"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("texts", nargs="+", help="UTF-8 text files to learn the merges from")
    parser.add_argument("--vocab", type=int, default=512, help="tokens in the vocabulary (default 512)")
    parser.add_argument("--out", required=True, help="where to write tokenizer.json")
    args = parser.parse_args()
    refusal = input_refusal(args.texts, args.vocab)
    if refusal:
        print(f"train_tokenizer: error: {refusal}", file=sys.stderr)
        raise SystemExit(2)
    tokenizer = train_tokenizer(args.texts, args.vocab)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(args.out)
    sample = tokenizer.encode("Alice was beginning to get very tired")
    print(f"wrote {args.out}: vocab {tokenizer.get_vocab_size()}; 'Alice was beginning to get very tired' -> "
          f"{len(sample.ids)} tokens {sample.tokens}")


if __name__ == "__main__":
    main()
