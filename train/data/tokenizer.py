"""Tokenizers, named by ``data.tokenizer``: text ↔ int32 token ids, and the document separator.

* ``"byte"`` (default): UTF-8 bytes, vocabulary 256, documents separated by ``b"\\n"`` (10).
* ``"hf:PATH"``: a Hugging Face ``tokenizer.json`` (or a directory holding one), read with the
  ``tokenizers`` library. The separator is the first of ``SEPARATOR_TOKENS`` the vocabulary
  holds (``<|endoftext|>`` for GPT-2 and the BPEs :func:`train_bpe` writes, ``</s>`` for Llama).
* ``"sentencepiece:PATH"``: a SentencePiece ``.model`` file; the separator is its EOS id.

Every tokenizer has a ``fingerprint``: its kind and the SHA-256 of its file. A prepared dataset
records the fingerprint it was tokenized with, so reading it with another tokenizer fails.
:func:`check_vocab` fills ``model.vocab_size`` from the tokenizer (when 0) or checks that it
covers every id. Errors are `config.ConfigError`s in one line naming the field.
"""

from __future__ import annotations

import abc
import functools
import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import sentencepiece
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from config import ConfigError

SEPARATOR_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")
BYTE_SEPARATOR = 10  # b"\n", the separator the byte-level pipeline has always used


class Tokenizer(abc.ABC):
    """Base class: ``encode(text) -> int32 ids``, ``decode(ids) -> text``, ``vocab_size``,
    ``separator`` (the id placed between packed documents), ``spec`` (as ``data.tokenizer``
    names it) and ``fingerprint``."""

    spec: str
    vocab_size: int
    separator: int
    fingerprint: str

    @abc.abstractmethod
    def encode(self, text: str) -> np.ndarray:
        """The int32 ids of `text`."""

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(text) for text in texts]

    @abc.abstractmethod
    def decode(self, ids: Any) -> str:
        """The text of `ids`."""

    def token_dtype(self) -> np.dtype:
        """The smallest unsigned dtype holding every id (how shards store tokens)."""
        for dtype in (np.uint8, np.uint16, np.uint32):
            if self.vocab_size <= np.iinfo(dtype).max + 1:
                return np.dtype(dtype)
        raise ValueError(f"vocabulary of {self.vocab_size} ids does not fit 32 bits")


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes; invalid UTF-8 on decoding (e.g. a cut multi-byte char) becomes U+FFFD."""

    spec = "byte"
    vocab_size = 256
    separator = BYTE_SEPARATOR
    fingerprint = "byte"

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids: Any) -> str:
        return np.asarray(ids, dtype=np.uint8).tobytes().decode("utf-8", errors="replace")

    @staticmethod
    def as_hugging_face() -> tokenizers.Tokenizer:
        """The same ids as a Hugging Face tokenizer (what an exported byte-level run ships as
        tokenizer.json): a byte-level BPE without merges over GPT-2's printable alphabet of the
        256 bytes, token id = byte value."""
        printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                     *range(ord("®"), ord("ÿ") + 1)]
        others = [byte for byte in range(256) if byte not in printable]
        symbol = {**{byte: chr(byte) for byte in printable},
                  **{byte: chr(256 + n) for n, byte in enumerate(others)}}
        tokenizer = tokenizers.Tokenizer(models.BPE(
            vocab={symbol[byte]: byte for byte in range(256)}, merges=[]))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                           use_regex=False)
        tokenizer.decoder = decoders.ByteLevel()
        return tokenizer


def _file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


class HuggingFaceTokenizer(Tokenizer):
    """A ``tokenizer.json`` read with the ``tokenizers`` library (no special tokens added)."""

    def __init__(self, spec: str, path: Path):
        self.spec, self.path = spec, path
        try:
            self._tokenizer = tokenizers.Tokenizer.from_file(str(path))
        except Exception as error:  # the library raises a bare Exception on a bad file
            reason = str(error).strip().splitlines()[0] if str(error).strip() else "unreadable"
            raise ConfigError(f"data.tokenizer={spec!r} is invalid: {path} is not a Hugging "
                              f"Face tokenizer.json ({reason}); pass a tokenizer.json written "
                              "by the tokenizers library") from None
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        separators = [vocab[token] for token in SEPARATOR_TOKENS if token in vocab]
        if separators:
            self.separator = separators[0]
        else:  # no end-of-text token: a newline, as the byte pipeline separates documents
            newline = self._tokenizer.encode("\n", add_special_tokens=False).ids
            if len(newline) != 1:
                raise ConfigError(f"data.tokenizer={spec!r} is invalid: its vocabulary has none "
                                  f"of {', '.join(SEPARATOR_TOKENS)} and no single newline "
                                  "token to separate documents; add an end-of-text token")
            self.separator = newline[0]
        self.fingerprint = f"hf:{_file_hash(path)}"

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tokenizer.encode(text, add_special_tokens=False).ids, np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encodings = self._tokenizer.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, np.int32) for e in encodings]

    def decode(self, ids: Any) -> str:
        return self._tokenizer.decode([int(i) for i in np.asarray(ids).reshape(-1)],
                                      skip_special_tokens=False)


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece ``.model`` file; the separator is its EOS id (else its newline piece)."""

    def __init__(self, spec: str, path: Path):
        self.spec, self.path = spec, path
        self._processor = sentencepiece.SentencePieceProcessor()
        try:
            self._processor.Load(str(path))
        except (OSError, RuntimeError) as error:
            reason = str(error).strip().splitlines()[0] if str(error).strip() else "unreadable"
            raise ConfigError(f"data.tokenizer={spec!r} is invalid: {path} is not a "
                              f"SentencePiece model ({reason}); pass a .model file") from None
        self.vocab_size = int(self._processor.GetPieceSize())
        eos = int(self._processor.eos_id())
        self.separator = eos if eos >= 0 else int(self._processor.EncodeAsIds("\n")[-1])
        self.fingerprint = f"sentencepiece:{_file_hash(path)}"

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._processor.EncodeAsIds(text), np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(ids, np.int32) for ids in self._processor.EncodeAsIds(texts)]

    def decode(self, ids: Any) -> str:
        return self._processor.DecodeIds([int(i) for i in np.asarray(ids).reshape(-1)])


KINDS = {"hf": HuggingFaceTokenizer, "sentencepiece": SentencePieceTokenizer}


@functools.lru_cache(maxsize=8)
def load_tokenizer(spec: str = "byte") -> Tokenizer:
    """The tokenizer ``data.tokenizer`` names: "byte", "hf:PATH" (a tokenizer.json or a
    directory holding one) or "sentencepiece:PATH" (a .model file)."""
    spec = spec or "byte"
    if spec == "byte":
        return ByteTokenizer()
    kind, _, path_text = spec.partition(":")
    if kind not in KINDS or not path_text:
        raise ConfigError(f"data.tokenizer={spec!r} is invalid: use 'byte', 'hf:PATH' (a "
                          "tokenizer.json) or 'sentencepiece:PATH' (a .model file)")
    path = Path(path_text).expanduser()
    if kind == "hf" and path.is_dir():
        path = path / "tokenizer.json"
    if path.is_dir():
        raise ConfigError(f"data.tokenizer={spec!r} is invalid: {path} is a directory, not a "
                          "file; give the path of the tokenizer's file")
    if not path.is_file():
        raise ConfigError(f"data.tokenizer={spec!r} is invalid: {path} does not exist; train "
                          "one with scripts/train_tokenizer.py or give the path of an existing "
                          "file")
    return KINDS[kind](spec, path)


def tokenizer_of(data_config: Any) -> Tokenizer:
    """The tokenizer a config's ``data`` section names (``byte`` when the field is absent)."""
    return load_tokenizer(data_config.get("tokenizer", None) or "byte")


def check_vocab(model_config: Any, tokenizer: Tokenizer) -> None:
    """Fill ``model.vocab_size`` from ``tokenizer`` when it is 0, else check it covers every id
    (a larger vocabulary, e.g. padded to a multiple of 128, is accepted)."""
    if model_config.vocab_size == 0:
        model_config.vocab_size = tokenizer.vocab_size
    elif model_config.vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"model.vocab_size={model_config.vocab_size} is invalid: data.tokenizer="
            f"{tokenizer.spec!r} has {tokenizer.vocab_size} tokens; set "
            f"model.vocab_size={tokenizer.vocab_size} (or 0 to take it from the tokenizer)")


def check_bpe_vocab_size(vocab_size: int) -> None:
    """A byte-level BPE's vocabulary holds the 256 bytes, the separator and at least one merge."""
    if vocab_size < 257 + 1:
        raise ConfigError(f"--vocab_size={vocab_size} is invalid: a byte-level BPE needs at "
                          "least 258 (256 bytes, the separator and one merge)")


def train_bpe(texts: Iterable[str], vocab_size: int, out_dir: str | Path) -> Path:
    """Train a byte-level BPE on ``texts`` with the ``tokenizers`` library; writes
    ``out_dir/tokenizer.json`` (``<|endoftext|>`` is id 0, the document separator) and
    returns its path. Every byte is in the initial alphabet, so any text round-trips."""
    check_bpe_vocab_size(vocab_size)
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[SEPARATOR_TOKENS[0]],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "tokenizer.json"
    tokenizer.save(str(path))
    (out_dir / "tokenizer_info.json").write_text(json.dumps(
        {"kind": "byte-level BPE", "vocab_size": tokenizer.get_vocab_size(),
         "separator": SEPARATOR_TOKENS[0]}, indent=2) + "\n")
    return path
