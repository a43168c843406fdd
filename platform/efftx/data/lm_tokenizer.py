"""Text <-> token ids for the language models: UTF-8 bytes (the default), or a Hugging Face ``tokenizers`` JSON.

``data.tokenizer`` (a path, "" = bytes) picks the tokenizer a language model trains on; the run's
``model.vocab_size`` then comes from it (:func:`configure_vocab`). A token LM's export carries the tokenizer as
``tokenizer.json`` (efftx.export.TOKENIZER_FILE), so generation and Serve read it from the export
(:func:`export_codec`) and never need the training machine's file.

Both codecs share one interface (:class:`ByteCodec`, :class:`TokenizerCodec`):

* ``encode(text) -> ids`` (no special tokens added: a prompt is its text), ``vocab_size``, ``unit`` (what a
  prompt length is counted in, for messages), ``sha256`` (identity of the tokenizer: "" for bytes; for a JSON,
  the SHA-256 of its canonical serialisation, which is the exported ``tokenizer.json``'s content),
* ``decoder(context)`` -> an incremental decoder: ``decode(ids) -> str`` returns only complete text, holding
  back the ids of a character whose bytes are not all there yet (a multi-byte UTF-8 character split over
  tokens, or over decoding steps), and ``flush()`` returns what is left (an incomplete tail as U+FFFD);
* ``continuation(context, ids) -> str``: the text of ``ids`` generated after ``context``, the same string the
  incremental decoder yields piece by piece (streamed and non-streamed answers agree).

Ids are the tokenizer's own ids (no offset: language models have no padding).
"""

from __future__ import annotations

import codecs
import hashlib
import os
from pathlib import Path
from typing import Sequence

from efftx.errors import DataError, ExportError

KEY = "data.tokenizer"
BYTES_VOCAB = 256
_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 6  # tokens of the prompt kept as the decoder's context (leading spaces, joined characters)


class _ByteDecoder:
    """UTF-8 incremental decoding of byte ids (a character may span steps)."""

    def __init__(self):
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def decode(self, ids: Sequence[int]) -> str:
        return self._dec.decode(bytes(int(i) for i in ids))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


class ByteCodec:
    """UTF-8 bytes: id = byte value, vocabulary 256 (what every byte-level model trains on)."""

    name = "bytes"
    unit = "bytes"
    vocab_size = BYTES_VOCAB
    sha256 = ""
    source = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def decoder(self, context: Sequence[int] = ()) -> _ByteDecoder:
        return _ByteDecoder()  # the context is whole characters (an encoded prompt): it changes nothing

    def continuation(self, context: Sequence[int], ids: Sequence[int]) -> str:
        return self.decode(ids)

    def to_json(self) -> None:
        return None


class _TokenDecoder:
    """Incremental decoding over a ``tokenizers`` decoder: the text of the ids after ``read`` is the decoded
    window ``ids[prefix:]`` minus the decoded ``ids[prefix:read]`` (the window's first tokens give context:
    a decoder that strips a leading space, or joins word pieces, treats the new ids as it does in the whole
    text). New text that ends in U+FFFD waits for more ids: a character's bytes may be spread over tokens."""

    def __init__(self, tok, context: Sequence[int]):
        self._tok = tok
        self._ids = [int(i) for i in context][-_CONTEXT_TOKENS:]
        self._prefix = 0
        self._read = len(self._ids)

    def _pending(self) -> tuple[str, str]:
        before = self._tok.decode(self._ids[self._prefix:self._read])
        return before, self._tok.decode(self._ids[self._prefix:])

    def decode(self, ids: Sequence[int]) -> str:
        self._ids.extend(int(i) for i in ids)
        if len(self._ids) == self._read:
            return ""
        before, now = self._pending()
        if len(now) <= len(before) or now.endswith(_REPLACEMENT) or not now.startswith(before):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        del self._ids[:self._prefix]  # keep only the context window
        self._read -= self._prefix
        self._prefix = 0
        return now[len(before):]

    def flush(self) -> str:
        if len(self._ids) == self._read:
            return ""
        before, now = self._pending()
        self._prefix = self._read = len(self._ids)
        return now[len(os.path.commonprefix([before, now])):]


class TokenizerCodec:
    """A Hugging Face ``tokenizers`` JSON (BPE, Unigram, ...), ids as the tokenizer numbers them."""

    name = "tokenizer"
    unit = "tokens"

    def __init__(self, json_text: str, source: str = "<string>", key: str = KEY):
        from efftx.data.text_tokens import HFTokenizer

        self._hf = HFTokenizer(json_text, source=source, offset=0, key=key)
        self._tok = self._hf._tok
        self.source = source
        self.vocab_size = self._hf.vocab_size
        self._json = self._tok.to_str()
        self.sha256 = hashlib.sha256(self._json.encode("utf-8")).hexdigest()

    @classmethod
    def from_file(cls, path: str | os.PathLike, key: str = KEY) -> "TokenizerCodec":
        path = Path(path).expanduser()
        if path.is_dir():
            raise DataError(f"{key}={path} is a folder; give the tokenizers JSON file (e.g. tokenizer.json)")
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise DataError(f"tokenizer file not found: {path} ({key}); train one with: python -m "
                            f"efftx.data.train_tokenizer CORPUS --vocab N") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise DataError(f"cannot read tokenizer file {path} ({key}): {exc}") from None
        codec = cls(text, source=str(path), key=key)
        if codec.vocab_size < 2:
            raise DataError(f"{path} ({key}) has a vocabulary of {codec.vocab_size}: not a trained tokenizer")
        return codec

    def to_json(self) -> str:
        """The canonical JSON text (what an export stores as tokenizer.json; its SHA-256 is ``sha256``)."""
        return self._json

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]):
        """``tokenizers`` Encodings (ids and character offsets) of ``texts``, encoded in parallel."""
        return self._tok.encode_batch(texts, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids])

    def decoder(self, context: Sequence[int] = ()) -> _TokenDecoder:
        return _TokenDecoder(self._tok, context)

    def continuation(self, context: Sequence[int], ids: Sequence[int]) -> str:
        dec = self.decoder(context)
        return dec.decode(ids) + dec.flush()


Codec = ByteCodec | TokenizerCodec


def load_codec(path: str = "", key: str = KEY) -> Codec:
    """``""`` -> :class:`ByteCodec`; a path -> :class:`TokenizerCodec` of that JSON (DataError naming ``key``)."""
    return TokenizerCodec.from_file(path, key=key) if path else ByteCodec()


def check_key(path: str) -> None:
    """What ``Config.validate`` checks of ``data.tokenizer`` (cheap: the file is parsed when the run is configured)."""
    if path and path.strip() != path:
        raise DataError(f"{KEY}={path!r} has leading or trailing spaces")
    if path and Path(path).expanduser().is_dir():
        raise DataError(f"{KEY}={path} is a folder; give the tokenizers JSON file (e.g. tokenizer.json)")


def configure_vocab(cfg, codec: Codec, recipe_vocab: int | None = None) -> None:
    """Set ``model.vocab_size`` from the tokenizer of ``data.tokenizer``. A value left as the byte models'
    (256) or the recipe's is replaced; any other value that differs from the tokenizer's vocabulary was set on
    purpose and is an error naming both keys."""
    n = codec.vocab_size
    have = cfg.model.vocab_size
    if have != n:
        if have not in (BYTES_VOCAB, recipe_vocab):
            raise DataError(f"model.vocab_size={have} but {KEY}={cfg.data.tokenizer} has a vocabulary of {n}: "
                            f"leave model.vocab_size unset (it comes from the tokenizer) or set it to {n}")
        cfg.model.vocab_size = n


def export_codec(folder: str | os.PathLike, cfg) -> Codec:
    """The codec of a language model export: its ``tokenizer.json`` when it has one, else bytes. A codec whose
    vocabulary is not the model's (``model.vocab_size``) is an ExportError."""
    from efftx.export import TOKENIZER_FILE

    token_file = Path(folder) / TOKENIZER_FILE
    if token_file.is_file():
        try:
            codec: Codec = TokenizerCodec(token_file.read_text(encoding="utf-8"), source=str(token_file),
                                          key=TOKENIZER_FILE)
        except (DataError, OSError, UnicodeDecodeError) as exc:
            raise ExportError(f"the export {folder} has an unreadable {TOKENIZER_FILE}: {exc}") from None
    elif cfg.data.tokenizer:
        raise ExportError(f"the export {folder} was trained with {KEY}={cfg.data.tokenizer} but holds no "
                          f"{TOKENIZER_FILE}")
    else:
        codec = ByteCodec()
    if codec.vocab_size != cfg.model.vocab_size:
        raise ExportError(f"the tokenizer of {folder} ({codec.source}) has {codec.vocab_size} ids, the model "
                          f"model.vocab_size={cfg.model.vocab_size}")
    return codec


def same_tokenizer(target: Codec, draft: Codec, names: tuple[str, str] = ("target", "draft")) -> str | None:
    """None when a draft can propose tokens for a target (same vocabulary and the same tokenizer: the byte
    codec, or tokenizers JSONs of one SHA-256); else the reason, naming both."""
    a, b = names
    if target.vocab_size != draft.vocab_size:
        return (f"the {a} has a vocabulary of {target.vocab_size}, the {b} {draft.vocab_size}: they must be the "
                f"same")
    if target.sha256 != draft.sha256:
        def what(c):
            return "bytes" if not c.sha256 else f"tokenizer {c.source} (sha256 {c.sha256[:12]})"

        return f"the {a} and the {b} tokenize differently ({a}: {what(target)}; {b}: {what(draft)}): they must share " \
               f"one tokenizer"
    return None
