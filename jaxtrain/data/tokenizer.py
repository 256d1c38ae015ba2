"""Tokenizers for text: bytes (256 tokens), a byte-level BPE trained on a text with Hugging Face ``tokenizers``, or
a Hugging Face ``tokenizer.json``; ``Tokenizer`` encodes a whole text in pieces (the same tokens as at once) and
decodes what a model samples. ``jaxtrain.data.text`` tokenizes its files with them.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import numpy as np

from jaxtrain.choices import TOKENIZERS
from jaxtrain.errors import ConfigError, named, need

_CHUNK = 1 << 15  # characters per piece the BPE encodes (in parallel, a batch of pieces at a time; larger is slower)
_CUT = re.compile(r"\S(?=[ \n]\S)")  # where a piece may end


def dtype(vocab: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab <= 65536 else np.uint32)


def need_tokenizers():
    """The ``tokenizers`` package (the ``text`` extra), or a one-line MissingExtra."""
    return need("tokenizers", f"text with {named('tokenizer', 'bpe')} or a tokenizer.json")


def _pieces(text: str):
    """``text`` in pieces of about ``_CHUNK`` characters, each cut before a single space or newline between two
    non-space characters: GPT-2's pattern (the byte-level pre-tokenizer's) splits there anyway, so the pieces give
    the very tokens of the whole text."""
    start = 0
    while start < len(text):
        cut = _CUT.search(text, start + _CHUNK)
        end = cut.end() if cut else len(text)
        yield text[start:end]
        start = end


class Tokenizer:
    """Text <-> token ids: ``name`` is "bytes", "bpe" or the tokenizer.json's path; ``vocab_size``: its largest
    token id + 1."""

    def __init__(self, name: str, vocab_size: int, hf=None):
        self.name, self.vocab_size, self._hf = name, vocab_size, hf  # hf: a tokenizers.Tokenizer (None: bytes)

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size})"

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text`` (uint16, or uint32 past 65536 tokens); no special tokens added."""
        if self._hf is None:
            return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.uint16)
        pieces, ids = _pieces(text), [np.zeros(0, dtype(self.vocab_size))]
        while group := list(itertools.islice(pieces, 256)):  # a batch at a time: their encodings are big
            try:
                encoded = self._hf.encode_batch(group, add_special_tokens=False)
            except Exception as e:  # tokenizers raises a bare Exception (a WordLevel's missing [UNK], ...)
                why = (str(e).splitlines() or [type(e).__name__])[0][:120]
                raise ConfigError(f"{named('tokenizer', self.name)}: cannot encode the text ({why}): give a "
                                  "tokenizer whose vocabulary covers every character (a byte-level BPE, like "
                                  f"GPT-2's), or {' or '.join(TOKENIZERS)}") from None
            ids += [np.array(e.ids, ids[0].dtype) for e in encoded]
        return np.concatenate(ids)

    def decode(self, ids) -> str:
        """The text of ``ids`` (bytes: invalid UTF-8, as a model may sample, becomes U+FFFD)."""
        ids = np.asarray(ids).ravel()
        if self._hf is None:
            return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
        return self._hf.decode(ids.tolist(), skip_special_tokens=False)

    def save(self, path) -> None:
        """Write a file ``load_tokenizer`` reads back (a tokenizer.json; for bytes ``{"bytes": true}``)."""
        Path(path).write_text('{"bytes": true}' if self._hf is None else self._hf.to_str())


def load_tokenizer(path, of_run: str | None = None) -> Tokenizer:
    """The tokenizer a file holds (``Tokenizer.save``'s, or any Hugging Face tokenizer.json), named by its path
    (the --tokenizer given); ``of_run``: a finished run's own file, named by the run (it is trained again)."""
    path = Path(path).expanduser()
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        why = getattr(e, 'strerror', None) or type(e).__name__
        if of_run:
            raise ConfigError(f"{of_run}: its {path.name} cannot be read ({why}); train it again") from None
        raise ConfigError(f"{named('tokenizer', path)}: cannot be read ({why}): give {' or '.join(TOKENIZERS)}, "
                          "or a tokenizer.json file") from None
    if len(text) < 100 and text.strip().replace(" ", "") == '{"bytes":true}':
        return Tokenizer("bytes", 256)
    tokenizers = need_tokenizers()
    try:
        hf = tokenizers.Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
        why = (str(e).splitlines() or [type(e).__name__])[0][:120]
        if of_run:
            raise ConfigError(f"{of_run}: its {path.name} is damaged (does not load as a Hugging Face "
                              f"tokenizer.json ({why})); train it again") from None
        raise ConfigError(f"{named('tokenizer', path)}: does not load as a Hugging Face tokenizer.json ({why}): "
                          f"give a tokenizer.json file, or {' or '.join(TOKENIZERS)}") from None
    hf.no_truncation(), hf.no_padding()  # a file's own settings would cut or pad each piece of the token stream
    # Its largest id + 1, not its count of tokens: some files' added tokens leave gaps in the ids.
    size = max(hf.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    if size < 2:
        raise ConfigError(f"{named('tokenizer', path)}: its vocabulary holds {size} token(s); a language model needs "
                          f"at least 2: give another tokenizer.json, or {' or '.join(TOKENIZERS)}")
    return Tokenizer(str(path), size, hf)


def vocab_size(tokenizer: str, bpe_vocab: int) -> int:
    """The vocabulary a run's model needs, known before any text is read: "bytes" 256; "bpe": ``bpe_vocab`` (the
    trained BPE has at most that many tokens); a tokenizer.json path: its vocabulary's size (the file read)."""
    if tokenizer == "bytes":
        return 256
    if tokenizer == "bpe":
        if not 257 <= bpe_vocab <= 65536:
            raise ConfigError(f"{named('bpe_vocab', bpe_vocab, setting='vocab_size')}: use 257 to 65536 (the 256 "
                              "bytes and at least one merge; at most 65536 so the tokens fit uint16)")
        return bpe_vocab
    return load_tokenizer(tokenizer).vocab_size


def train_bpe(text: str, bpe_vocab: int) -> Tokenizer:
    """A byte-level BPE of at most ``bpe_vocab`` tokens trained on ``text`` (its 256 byte symbols always in, so any
    text encodes); the same text gives the same tokenizer."""
    tk = need_tokenizers()
    hf = tk.Tokenizer(tk.models.BPE())
    hf.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=bpe_vocab, initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
                                     show_progress=False)
    hf.train_from_iterator(_pieces(text), trainer=trainer)
    return Tokenizer("bpe", hf.get_vocab_size(), hf)
