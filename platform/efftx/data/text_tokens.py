"""Caption tokens for DALL-E: a byte-level tokenizer by default, a Hugging Face ``tokenizers`` JSON on request.

Id convention, the same for every tokenizer (this is what the model sees):

* ``PAD_ID = 0`` is padding and nothing else. Text ids start at 1: the byte tokenizer maps byte ``b``
  to ``b + 1`` (``vocab_size`` 257); a ``tokenizers`` JSON's id ``i`` becomes ``i + 1``
  (``vocab_size`` = its vocabulary + 1). So no tokenizer can produce a text token that looks like
  padding, whatever its own special tokens are.
* A caption becomes ``text_seq_len`` ids: its tokens, then ``PAD_ID`` up to the length. The model
  tells text from padding with :func:`padding_mask` (``tokens != PAD_ID``): the mask is *derived*
  from the ids, never stored beside them, so the two cannot disagree.
* A caption longer than ``text_seq_len`` tokens is cut to ``text_seq_len`` when ``truncate`` is on
  (``data.image.truncate_captions``), else it is a :class:`~efftx.errors.DataError` naming where the
  caption came from (its file, or shard and key).

The byte tokenizer needs no file and no network; it is what the ``shapes`` debug recipes use.
A ``tokenizers`` JSON (the seed's ``--bpe_path --hug``) is read from a local file; its text can be
stored in an export with :meth:`HFTokenizer.to_json` so that a model carries its own tokenizer.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np
import torch

from efftx.errors import DataError

PAD_ID = 0
_OFFSET = 1  # text ids = tokenizer ids + 1, so that 0 stays padding


class Tokenizer(Protocol):
    name: str
    vocab_size: int  # ids are in [0, vocab_size); 0 is padding

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes, id = byte + 1. Decoding skips padding and replaces invalid UTF-8."""

    name = "bytes"
    vocab_size = 256 + _OFFSET

    def encode(self, text: str) -> list[int]:
        return [b + _OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        data = bytes(int(i) - _OFFSET for i in ids if _OFFSET <= int(i) < self.vocab_size)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizers`` JSON (BPE, WordPiece, ...), ids shifted by one so 0 stays padding.

    No special tokens are added to captions (``add_special_tokens=False``): a caption is its text.
    """

    name = "hf"

    def __init__(self, json_text: str, source: str = "<string>", *, offset: int = _OFFSET,
                 key: str = "data.image.bpe_path"):
        """``offset``: added to the tokenizer's ids (1 for captions, so 0 stays padding; the language models'
        tokenizer, efftx.data.lm_tokenizer, uses 0). ``key``: the config key named in errors."""
        try:
            from tokenizers import Tokenizer as _HF
        except ImportError:  # pragma: no cover - it is a dependency in pyproject.toml
            raise DataError(f"{key} needs the 'tokenizers' package: pip install tokenizers") from None
        try:
            self._tok = _HF.from_str(json_text)
        except Exception as exc:  # tokenizers raises a plain Exception on bad JSON
            raise DataError(f"{source} is not a Hugging Face tokenizers JSON file ({key}): {exc}") from None
        self.source = source
        self.offset = offset
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True) + offset

    @classmethod
    def from_file(cls, path: str | os.PathLike, *, offset: int = _OFFSET, key: str = "data.image.bpe_path"
                  ) -> "HFTokenizer":
        path = Path(path).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise DataError(f"tokenizer file not found: {path} ({key})") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise DataError(f"cannot read tokenizer file {path} ({key}): {exc}") from None
        return cls(text, source=str(path), offset=offset, key=key)

    def to_json(self) -> str:
        """The tokenizer as JSON text (store it in an export; :class:`HFTokenizer` rebuilds it)."""
        return self._tok.to_str()

    def encode(self, text: str) -> list[int]:
        return [i + self.offset for i in self._tok.encode(text, add_special_tokens=False).ids]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) - self.offset for i in ids if self.offset <= int(i) < self.vocab_size])


def load_tokenizer(bpe_path: str = "") -> Tokenizer:
    """``""`` -> :class:`ByteTokenizer`; a path -> :class:`HFTokenizer` read from that JSON file."""
    return HFTokenizer.from_file(bpe_path) if bpe_path else ByteTokenizer()


def tokenize(tokenizer: Tokenizer, text: str, text_seq_len: int, *, truncate: bool, source: str = "caption") -> np.ndarray:
    """One caption -> ``(text_seq_len,)`` int64 ids, padded with ``PAD_ID``.

    ``source`` names where the caption came from (a file, ``shard.tar:key.txt``) in the error raised
    when it is too long and ``truncate`` is off.
    """
    ids = tokenizer.encode(text)
    if len(ids) > text_seq_len:
        if not truncate:
            raise DataError(f"caption in {source} is {len(ids)} tokens long, more than text_seq_len={text_seq_len}: "
                            f"set data.image.truncate_captions=true to cut it, or raise the model's text_seq_len "
                            f"(caption: {text[:80]!r})")
        ids = ids[:text_seq_len]
    out = np.full(text_seq_len, PAD_ID, dtype=np.int64)
    out[: len(ids)] = ids
    return out


def tokenize_batch(tokenizer: Tokenizer, texts: Sequence[str], text_seq_len: int, *, truncate: bool = True) -> torch.Tensor:
    """Prompts -> ``(B, text_seq_len)`` int64 (generation and serving; truncates by default)."""
    rows = [tokenize(tokenizer, t, text_seq_len, truncate=truncate, source=f"prompt {i}") for i, t in enumerate(texts)]
    return torch.from_numpy(np.stack(rows)) if rows else torch.zeros(0, text_seq_len, dtype=torch.long)


def padding_mask(tokens: torch.Tensor) -> torch.Tensor:
    """``True`` where ``tokens`` hold text, ``False`` on padding (same shape)."""
    return tokens != PAD_ID


def decode_tokens(tokenizer: Tokenizer, tokens: torch.Tensor | Sequence[int]) -> str:
    """One row of ids -> text, padding dropped."""
    ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
    return tokenizer.decode([i for i in ids if i != PAD_ID])
