"""Text from disk for a GPT language model: one file or a folder of them, tokenized once and kept as token files.

    PATH         one UTF-8 text file
    PATH/**      every file under a folder, sorted by relative path (hidden ones left out), joined with blank lines

The joined text's last ``val_fraction`` of characters is the validation split ("test"), the rest the training
split. The tokenizer (``jaxtrain.data.tokenizer``) is ``bytes`` (UTF-8 bytes, 256 tokens), ``bpe`` (a
byte-level BPE trained on the training text only, so validation stays unseen) or a Hugging Face
``tokenizer.json``. The tokens and the tokenizer are
kept in the cache under a digest of the files' names and bytes, the tokenizer and ``val_fraction``: a second run
maps the token files instead of tokenizing again. Windows of ``seq_len + 1`` tokens are cut when read, so one
cache serves every ``seq_len``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from pathlib import Path

import numpy as np

from jaxtrain import settings
from jaxtrain.choices import BPE_VOCAB, TOKENIZERS
from jaxtrain.errors import ConfigError, named
from jaxtrain.io import console
from jaxtrain.io.dirlock import DirLock
from jaxtrain.data import tokenizer as tokenizer_lib
from jaxtrain.data.tokenizer import Tokenizer, load_tokenizer, train_bpe, vocab_size  # noqa: F401 (text's API)

SPLITS = ("train", "test")
log = logging.getLogger(__name__)
_SHIFT_SALT = 0x7E47  # the windows' shift has its own random stream, apart from the loader's shuffle of (seed, epoch)
@dataclasses.dataclass(frozen=True)
class TextSplit:
    """A split's tokens (a map of its cached token file) read as windows of ``seq_len + 1`` tokens: inputs
    ``tokens[:-1]``, targets ``tokens[1:]``; ``vocab``: the model's vocabulary (``vocab_size``)."""

    tokens: np.ndarray
    seq_len: int
    vocab: int
    raw = False  # small integer batches, cut in the loader's threads (no worker processes)

    @property
    def num_classes(self) -> int:
        return self.vocab  # next-token prediction: a class per token

    def __len__(self) -> int:
        """Windows per epoch: window ``i`` starts at ``i * seq_len + shift``, and fits for every shift < seq_len."""
        return max(len(self.tokens) // self.seq_len - 1, 0)

    def rows(self, idx: np.ndarray, *, train: bool, augment, seed: int, epoch: int) -> tuple[dict, list, list]:
        """({"tokens": int32 [len(idx), seq_len + 1]}, [], []): windows ``idx``. Training shifts every window by
        one offset drawn from (seed, epoch) alone: each token is in exactly one window per epoch, the epochs'
        windows differ, and a resumed run cuts the same ones. Evaluation: window ``i`` starts at ``i * seq_len``."""
        if augment not in (None, "none"):
            raise ConfigError(f"{named('augment', augment)}: text has no augmentation: use {named('augment', 'none')}")
        idx = np.asarray(idx, np.int64).ravel()
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"windows {idx.min()}..{idx.max()} asked of a split of {len(self)}")
        span = self.seq_len + 1
        shift = int(np.random.default_rng([seed, epoch, _SHIFT_SALT]).integers(self.seq_len)) if train else 0
        out = np.empty((len(idx), span), np.int32)
        for row, start in enumerate(idx * self.seq_len + shift):
            out[row] = self.tokens[start:start + span]
        return {"tokens": out}, [], []

    def head(self, n: int | None) -> "TextSplit":
        """The first ``n`` windows' tokens (all for None): ``len`` is ``n``."""
        if n is None or n >= len(self):
            return self
        return dataclasses.replace(self, tokens=self.tokens[:(max(n, 0) + 1) * self.seq_len])


def _listing(path: Path) -> list[tuple[str, Path]]:
    """[(relative name, file)] of the text at ``path``: the file itself, or a folder's files sorted by relative
    path, hidden files and folders left out; empty files are left out too (they add no text)."""
    if path.is_file():
        found = [(path.name, path)]
    else:
        found = []
        for top, dirs, names in os.walk(path):  # links to folders not followed: no loops
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            found += [(Path(top, n).relative_to(path).as_posix(), Path(top, n)) for n in names
                      if not n.startswith(".") and Path(top, n).is_file()]
        if not found:
            raise ConfigError(f"text:{path}: a folder with no files: put text files in it")
    found = [(rel, file) for rel, file in sorted(found) if file.stat().st_size]
    if not found:
        raise ConfigError(f"text:{path}: only empty files: give files with text in them")
    return found


def _digest(files, tokenizer: str, bpe_vocab: int, val_fraction: float) -> str:
    """sha256 of what the cache holds: the files' names and bytes, the tokenizer (bpe: its size; a tokenizer.json:
    its bytes, not where it is) and ``val_fraction``."""
    kind = tokenizer if tokenizer in TOKENIZERS else "file"
    h = hashlib.sha256(json.dumps(["jaxtrain text 1", kind, bpe_vocab if kind == "bpe" else None,
                                   val_fraction]).encode())
    for rel, file in ([("tokenizer.json", Path(tokenizer).expanduser())] if kind == "file" else []) + files:
        try:
            h.update(json.dumps([rel, file.stat().st_size]).encode())
            with open(file, "rb") as f:
                while block := f.read(1 << 22):
                    h.update(block)
        except OSError as e:
            raise ConfigError(f"{file}: cannot be read ({e.strerror}): make it readable or remove it") from None
    return h.hexdigest()


def _read_text(files) -> str:
    """The files' text joined with blank lines; a file that is not UTF-8 text is a ConfigError naming it."""
    documents = []
    for _, file in files:
        data = file.read_bytes()
        try:
            if b"\0" in data:
                raise UnicodeError("NUL bytes")
            documents.append(data.decode("utf-8"))
        except UnicodeError as e:
            if data[:2] in (b"\xff\xfe", b"\xfe\xff"):  # UTF-16's byte order mark (Windows writes it): NULs galore
                raise ConfigError(f"{file}: UTF-16 text, not UTF-8: convert it to UTF-8 (iconv -f utf-16 -t utf-8) "
                                  "or remove it") from None
            if b"\0" in data:
                raise ConfigError(f"{file}: a binary file, not UTF-8 text (it holds NUL bytes): remove it") from None
            raise ConfigError(f"{file}: not UTF-8 text (byte {e.start} is not UTF-8; another encoding, such as "
                              f"Latin-1?): convert it to UTF-8 (iconv -f latin1 -t utf-8) or remove it") from None
    return "\n\n".join(documents)


def _check(where: Path) -> tuple[dict | None, str]:
    """(the cache's record, "") when ``where`` holds a whole cache; (None, "") when not built; (None, why) when
    damaged."""
    try:
        meta = json.loads((where / "meta.json").read_text())
        sizes = {f"{name}.tokens": meta[name] * np.dtype(meta["dtype"]).itemsize for name in SPLITS}
    except FileNotFoundError:
        return None, ""
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"meta.json does not read ({type(e).__name__})"
    if not (where / "tokenizer.json").is_file():
        return None, "tokenizer.json is missing"
    for name, size in sizes.items():
        if not (where / name).is_file() or (where / name).stat().st_size != size:
            return None, f"{name} is not {size} bytes"
    return meta, ""


def _written(path: Path, write) -> None:
    """``write(name)`` to a temporary name beside ``path``, then renamed: a reader sees all of it or nothing."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write(tmp)
    os.replace(tmp, path)


def _build(where: Path, files, tokenizer: str, bpe_vocab: int, val_fraction: float, vocab: int) -> dict:
    """Read and split the text, make the tokenizer, and keep the tokens and the tokenizer in ``where``."""
    start = time.perf_counter()
    text = _read_text(files)
    cut = round(len(text) * (1 - val_fraction))
    parts = {"train": text[:cut], "test": text[cut:]}
    tok = (Tokenizer("bytes", 256) if tokenizer == "bytes" else train_bpe(parts["train"], bpe_vocab)
           if tokenizer == "bpe" else load_tokenizer(tokenizer))
    where.mkdir(parents=True, exist_ok=True)
    (where / "meta.json").unlink(missing_ok=True)  # the record goes last: a half-made cache is never read
    meta = {"dtype": tokenizer_lib.dtype(vocab).name, "vocab": vocab, "files": len(files), "characters": len(text)}
    for name, part in parts.items():
        ids = tok.encode(part).astype(tokenizer_lib.dtype(vocab), copy=False)
        _written(where / f"{name}.tokens", ids.tofile)
        meta[name] = len(ids)
    _written(where / "tokenizer.json", tok.save)
    _written(where / "meta.json", lambda tmp: tmp.write_text(json.dumps(meta)))
    log.info(f"tokenized {len(files)} file(s) with {tok.name}: {len(text):,} characters -> "
             f"{meta['train'] + meta['test']:,} tokens in {time.perf_counter() - start:.1f} s")
    return meta


@console.shown
def load(path, *, seq_len: int, tokenizer: str = "bpe", bpe_vocab: int = BPE_VOCAB, val_fraction: float = 0.1,
         cache_dir: Path | None = None, warn=None) -> tuple[dict[str, TextSplit], Tokenizer, str]:
    """({"train": TextSplit, "test": TextSplit}, the tokenizer, the digest of what they hold) of the text at
    ``path`` (layout above), tokenized once into ``cache_dir`` (default: beside the folder indexes, in "text").

    Runs that tokenize the same text at once take turns on a lock: the first tokenizes, the others read its
    files. ``warn``: how a damaged cache, tokenized again, is said (default: a warning in the log)."""
    if not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
        raise ConfigError(f"{named('seq_len', seq_len)}: give the tokens a window holds, 1 or more (e.g. 256)")
    if not 0 < val_fraction < 1:
        raise ConfigError(f"{named('val_fraction', val_fraction)}: give the share of the text held out for validation, "
                          "between 0 and 1 (e.g. 0.1)")
    vocab = vocab_size(tokenizer, bpe_vocab)
    root = Path(path).expanduser()
    if not root.exists():  # first: the text itself, then what reading it needs
        raise ConfigError(f"text:{path}: no such file or folder: give a text file, or a folder of them")
    if tokenizer == "bpe":
        tokenizer_lib.need_tokenizers()
    files = _listing(root.resolve())
    digest = _digest(files, tokenizer, bpe_vocab, val_fraction)
    cache = Path(cache_dir) if cache_dir is not None else settings.current().index_cache.parent / "text"
    where = cache / digest
    meta, _ = _check(where)
    if meta is None:
        try:
            cache.mkdir(parents=True, exist_ok=True)
            with DirLock(cache, named("cache_dir"), name=f".{digest[:32]}.lock",
                         waiting=f"waiting for another run tokenizing {root}"):
                meta, damage = _check(where)  # another run may have made it while this one waited
                if damage:
                    (warn or log.warning)(f"the cached tokens of {root} in {where} are damaged ({damage}): "
                                          "tokenizing again")
                if meta is None:
                    meta = _build(where, files, tokenizer, bpe_vocab, val_fraction, vocab)
        except OSError as e:
            raise ConfigError(f"{cache}: the tokens cannot be kept there ({e.strerror or type(e).__name__}): pass "
                              "another cache_dir, or set JAXTRAIN_INDEX_CACHE to a writable directory") from None
    tok = load_tokenizer(where / "tokenizer.json")
    tok.name = tokenizer
    splits = {}
    for name in SPLITS:
        n, dtype = meta[name], np.dtype(meta["dtype"])
        tokens = np.memmap(where / f"{name}.tokens", dtype, mode="r") if n else np.zeros(0, dtype)
        splits[name] = TextSplit(tokens, seq_len, vocab)
        if not len(splits[name]):
            part = "training" if name == "train" else "validation"
            raise ConfigError(f"text:{path}: its {part} part has {n} tokens, a window of "
                              f"{named('seq_len', seq_len)} needs {2 * seq_len} (seq_len + 1 at any shift): give a "
                              f"smaller {named('seq_len')} or more text"
                              + (f", or a larger {named('val_fraction')}" if name == "test" else ""))
    return splits, tok, digest
