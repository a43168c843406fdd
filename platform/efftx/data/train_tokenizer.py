"""Train a tokenizer for the language models: ``python -m efftx.data.train_tokenizer CORPUS --vocab N``.

    python -m efftx.data.train_tokenizer CORPUS --vocab N [--kind bpe|unigram] [--out PATH] [--force]
                                         [--cache-dir DIR]

CORPUS is what ``data.corpus`` takes: ``bundled``, a text file, a folder of them, or enwik8 (``.zip`` / ``.gz``).
The tokenizer is trained with the Hugging Face ``tokenizers`` library on the corpus's *training split* only (the
first 90% of its bytes, the split training uses; the validation text stays unseen) and is byte-level: its base
vocabulary is the 256 bytes and its pre-tokenizer and decoder work on bytes, so any text encodes and decodes back
unchanged, whatever its characters. ``--kind bpe`` (default) learns merges; ``--kind unigram`` a unigram language
model over the same byte alphabet. ``--vocab`` counts every id (the 256 bytes included).

It writes a tokenizers JSON (default ``<efftx home>/tokenizers/<corpus>-<kind>-<vocab>.json``; an existing file is
kept unless ``--force``) and prints the command that trains a language model on it (``--set data.tokenizer=PATH``).
A missing corpus, a vocabulary of 256 or fewer ids or an existing output file is exit code 2 with one line saying so.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from efftx import paths
from efftx.data.bytes import _atomic_write, prepare
from efftx.errors import DataError
from efftx.data.token_corpus import _pieces, split_bounds

KINDS = ("bpe", "unigram")
MIN_VOCAB = 257  # the 256 bytes, and at least one learned token


def _texts(path: str, start: int, end: int):
    """The training split's text, in pieces cut at line starts (what the trainer counts words over)."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    text = bytes(data[start:end]).decode("utf-8", errors="replace")
    for s, e in _pieces(text):
        yield text[s:e]


def build(kind: str, vocab: int):
    """An untrained byte-level tokenizer of ``kind`` and its trainer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if kind == "bpe":
        tok = Tokenizer(models.BPE())
        trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=alphabet, show_progress=False)
    else:
        tok = Tokenizer(models.Unigram())
        trainer = trainers.UnigramTrainer(vocab_size=vocab, initial_alphabet=alphabet, show_progress=False)
    # no prefix space: a text's tokens cover exactly its bytes (bits per byte counts them)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok, trainer


def train(corpus: str, vocab: int, kind: str = "bpe", out: str | None = None, *, force: bool = False,
          cache_dir: str | None = None) -> dict:
    """Train and write the tokenizer; -> {"path", "kind", "vocab_size", "corpus", "train_bytes"}. DataError on bad
    input (naming the argument)."""
    if kind not in KINDS:
        raise DataError(f"--kind must be one of {', '.join(KINDS)}; got {kind!r}")
    if vocab < MIN_VOCAB:
        raise DataError(f"--vocab {vocab} is too small: a byte-level tokenizer has the 256 bytes as its base, so "
                        f"--vocab must be at least {MIN_VOCAB} (for plain bytes, leave data.tokenizer unset)")
    info = prepare(corpus, cache_dir or paths.default_data_dir(), seq_len=1)
    name = "bundled" if corpus == "bundled" else Path(corpus).expanduser().name.split(".")[0] or "corpus"
    target = Path(out).expanduser() if out else Path(paths.home()) / "tokenizers" / f"{name}-{kind}-{vocab}.json"
    if target.is_dir():
        raise DataError(f"--out {target} is a folder; give a file name (e.g. {target / 'tokenizer.json'})")
    if target.exists() and not force:
        raise DataError(f"{target} exists; pass --force to replace it, or --out another file")
    data = np.memmap(info.path, dtype=np.uint8, mode="r")
    (start, end), _ = split_bounds(data)
    tok, trainer = build(kind, vocab)
    tok.train_from_iterator(_texts(info.path, start, end), trainer=trainer)
    target.parent.mkdir(parents=True, exist_ok=True)
    text = tok.to_str(pretty=True)
    _atomic_write(target, lambda fh: fh.write(text.encode("utf-8")))
    return {"path": str(target.resolve()), "kind": kind, "vocab_size": tok.get_vocab_size(with_added_tokens=True),
            "corpus": corpus, "train_bytes": end - start}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m efftx.data.train_tokenizer", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.split("\n\n")[2:4]))
    p.add_argument("corpus", help="'bundled', a text file, a folder of them, or enwik8 (.zip/.gz): as data.corpus")
    p.add_argument("--vocab", type=int, required=True, help=f"ids in all, the 256 bytes included (>= {MIN_VOCAB})")
    p.add_argument("--kind", default="bpe", choices=KINDS)
    p.add_argument("--out", help="where to write the JSON (default: <efftx home>/tokenizers/CORPUS-KIND-VOCAB.json)")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    p.add_argument("--cache-dir", help="the corpus cache (default: efftx's data cache, where training looks)")
    args = p.parse_args(argv)
    try:
        report = train(args.corpus, args.vocab, args.kind, args.out, force=args.force, cache_dir=args.cache_dir)
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {report['path']}: byte-level {report['kind']} tokenizer, vocabulary {report['vocab_size']:,}, "
          f"trained on the {report['train_bytes']:,}-byte training split of {report['corpus']}\n"
          f"use it:  .venv/bin/python jobs/train_lm.py --recipe lm_small --set data.corpus={report['corpus']} "
          f"--set data.tokenizer={report['path']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
