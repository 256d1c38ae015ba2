"""Text for a language model (``jaxtrain.data.text``): the tokenizers, the token cache, the windows, bad input."""

import concurrent.futures
import json
import sys
import time

import numpy as np
import pytest

from jaxtrain import errors
from jaxtrain.data import text, tokenizer
from jaxtrain.errors import ConfigError

WORDS = ("the", "a", "river", "stone", "light", "cat", "sat", "under", "naïve", "café", "über", "quickly", "of",
         "ran", "bird", "tree", "Zürich", "and", "then", "42", "slowly", "mat", "fish", "dark")


def sentences(n: int, seed: int = 0) -> str:
    """``n`` lines of made-up sentences (some words not ASCII)."""
    rng = np.random.default_rng(seed)
    return "\n".join(" ".join(rng.choice(WORDS, rng.integers(4, 12))).capitalize() + "." for _ in range(n))


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(sentences(400))
    return path


def load(path, cache, **kwargs):
    kwargs = {"seq_len": 16, "bpe_vocab": 400, **kwargs}
    return text.load(path, cache_dir=cache, **kwargs)


def parts(path, val_fraction=0.1) -> tuple[str, str]:
    whole = path.read_text()
    cut = round(len(whole) * (1 - val_fraction))
    return whole[:cut], whole[cut:]


def test_bytes_tokens_are_the_utf8_bytes(tmp_path, corpus):
    splits, tok, _ = load(corpus, tmp_path / "c", tokenizer="bytes")
    train, test = parts(corpus)
    assert np.array_equal(splits["train"].tokens, np.frombuffer(train.encode(), np.uint8))
    assert np.array_equal(splits["test"].tokens, np.frombuffer(test.encode(), np.uint8))
    assert splits["train"].tokens.dtype == np.uint16 and splits["train"].num_classes == tok.vocab_size == 256
    assert text.vocab_size("bytes", 0) == 256 and tok.name == "bytes"
    assert tok.decode(tok.encode("Grüße, 東京 😀")) == "Grüße, 東京 😀"
    assert tok.decode([0x66, 0xC3]) == "f\ufffd"  # a cut character, as a model may sample: replaced
    tok.save(tmp_path / "bytes.json")
    assert text.load_tokenizer(tmp_path / "bytes.json").vocab_size == 256


def test_bpe_is_trained_on_the_training_text_and_round_trips_any_text(tmp_path, corpus):
    splits, tok, _ = load(corpus, tmp_path / "c")
    train, test = parts(corpus)
    assert tok.name == "bpe" and 256 < tok.vocab_size <= 400 and splits["train"].vocab == 400
    assert np.array_equal(splits["train"].tokens, tok.encode(train)) and tok.decode(tok.encode(train)) == train
    assert np.array_equal(splits["test"].tokens, tok.encode(test))
    unseen = "Ærøskøbing's ñandú \t\t flew 東京 → 😀\n\n  twice"
    assert tok.decode(tok.encode(unseen)) == unseen
    assert len(tok.encode(train)) < len(train.encode()) / 2  # the merges do compress


def test_bpe_training_is_deterministic(tmp_path, corpus):
    first, tok1, digest1 = load(corpus, tmp_path / "c1")
    second, tok2, digest2 = load(corpus, tmp_path / "c2")
    assert digest1 == digest2  # a digest of the inputs, not of where the cache is
    assert ((tmp_path / "c1" / digest1 / "tokenizer.json").read_bytes()
            == (tmp_path / "c2" / digest2 / "tokenizer.json").read_bytes())
    assert np.array_equal(first["train"].tokens, second["train"].tokens)


def test_pieces_encode_as_the_whole_text(corpus, monkeypatch):
    whole = corpus.read_text() + "\n  indented\n\nx\ny don't  two  spaces\t tab 12 345 ,. 'quoted' end"
    tok = tokenizer.train_bpe(whole, 400)
    reference = tok._hf.encode(whole, add_special_tokens=False).ids
    monkeypatch.setattr(tokenizer, "_CHUNK", 50)
    assert len(list(tokenizer._pieces(whole))) > 10 and "".join(tokenizer._pieces(whole)) == whole
    assert tok.encode(whole).tolist() == reference


def test_a_tokenizer_json_file_is_used_as_it_is(tmp_path, corpus):
    _, trained, _ = load(corpus, tmp_path / "c", bpe_vocab=300)
    saved = tmp_path / "tokenizer.json"
    trained.save(saved)
    assert text.vocab_size(str(saved), 4096) == trained.vocab_size == text.load_tokenizer(saved).vocab_size
    assert text.vocab_size("bpe", 257) == 257 and text.vocab_size("bpe", 65536) == 65536
    with pytest.raises(ConfigError, match="bpe_vocab=256: use 257 to 65536"):
        text.vocab_size("bpe", 256)
    with pytest.raises(ConfigError, match="missing.json: cannot be read"):
        text.vocab_size(str(tmp_path / "missing.json"), 4096)
    other = tmp_path / "other.txt"
    other.write_text(sentences(300, seed=1))
    splits, tok, _ = load(other, tmp_path / "c", tokenizer=str(saved))
    assert tok.name == str(saved) and splits["train"].vocab == trained.vocab_size
    assert np.array_equal(splits["train"].tokens, trained.encode(parts(other)[0]))


def test_training_windows_share_one_shift_per_epoch_and_cover_each_token_once(tmp_path, corpus):
    split = load(corpus, tmp_path / "c", seq_len=8)[0]["train"]
    T, n = 8, len(split)
    assert n == len(split.tokens) // T - 1 and n > 10
    idx = np.arange(n)
    shifts = []
    for epoch in range(4):
        windows = split.rows(idx, train=True, augment=None, seed=3, epoch=epoch)[0]["tokens"]
        assert windows.dtype == np.int32 and windows.shape == (n, T + 1)
        shift = next(s for s in range(T) if np.array_equal(windows[0], split.tokens[s:s + T + 1]))
        starts = idx * T + shift
        assert all(np.array_equal(w, split.tokens[s:s + T + 1]) for w, s in zip(windows, starts))
        inputs = (starts[:, None] + np.arange(T)).ravel()  # each position in [shift, shift + n*T) once
        assert np.array_equal(np.sort(inputs), np.arange(shift, shift + n * T))
        again = split.rows(idx[::-1], train=True, augment="none", seed=3, epoch=epoch)[0]["tokens"]
        assert np.array_equal(again, windows[::-1])  # the same (seed, epoch, idx): the same windows
        shifts.append(shift)
    assert len(set(shifts)) > 1
    evaluation = split.rows(np.array([0, 5]), train=False, augment=None, seed=3, epoch=2)[0]["tokens"]
    assert np.array_equal(evaluation, [split.tokens[0:T + 1], split.tokens[5 * T:6 * T + 1]])
    with pytest.raises(IndexError):
        split.rows(np.array([n]), train=False, augment=None, seed=0, epoch=0)
    with pytest.raises(ConfigError, match="augment=crop"):
        split.rows(idx[:1], train=True, augment="crop", seed=0, epoch=0)


def test_head_keeps_the_first_windows(tmp_path, corpus):
    split = load(corpus, tmp_path / "c", seq_len=8)[0]["train"]
    assert len(split.head(5)) == 5 and split.head(None) is split and split.head(10**6) is split
    assert np.array_equal(split.head(5).rows(np.arange(5), train=False, augment=None, seed=0, epoch=0)[0]["tokens"],
                          split.rows(np.arange(5), train=False, augment=None, seed=0, epoch=0)[0]["tokens"])
    assert split.raw is False and split.head(5).num_classes == split.vocab


def test_the_cache_is_read_the_second_time_and_rebuilt_when_damaged(tmp_path, corpus, monkeypatch, capsys):
    built = []
    real = text._build
    monkeypatch.setattr(text, "_build", lambda *a: built.append(a) or real(*a))
    first, _, digest = load(corpus, tmp_path / "c")
    assert len(built) == 1 and "tokenized 1 file(s) with bpe" in capsys.readouterr().out  # one line, as a run says
    second, _, again = load(corpus, tmp_path / "c", seq_len=32)  # another seq_len: the same cache
    assert len(built) == 1 and again == digest
    assert np.array_equal(first["train"].tokens, second["train"].tokens) and isinstance(second["train"].tokens,
                                                                                        np.memmap)
    where = tmp_path / "c" / digest
    tokens = (where / "train.tokens").read_bytes()
    (where / "train.tokens").write_bytes(tokens[:-2])
    warned = []
    third = load(corpus, tmp_path / "c", warn=warned.append)[0]
    assert len(built) == 2 and len(warned) == 1 and "train.tokens" in warned[0] and "damaged" in warned[0]
    assert (where / "train.tokens").read_bytes() == tokens and np.array_equal(third["test"].tokens,
                                                                              first["test"].tokens)
    (where / "tokenizer.json").unlink()
    load(corpus, tmp_path / "c", warn=warned.append)
    assert len(built) == 3 and "tokenizer.json is missing" in warned[1]
    assert not list(where.glob(".*tmp*"))  # the temporary names were all renamed


def test_runs_tokenizing_the_same_text_at_once_take_turns(tmp_path, corpus, monkeypatch):
    built = []
    real = text._build
    monkeypatch.setattr(text, "_build", lambda *a: built.append(a) or time.sleep(0.3) or real(*a))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # each its own lock file descriptor: as two processes
        results = list(pool.map(lambda _: load(corpus, tmp_path / "c"), range(2)))
    assert len(built) == 1 and results[0][2] == results[1][2]
    assert np.array_equal(results[0][0]["train"].tokens, results[1][0]["train"].tokens)


def test_the_digest_names_the_inputs(tmp_path, corpus, use_settings):
    use_settings(index_cache=tmp_path / "settings-cache" / "folders")
    digest = text.load(corpus, seq_len=16, bpe_vocab=400)[2]
    assert (tmp_path / "settings-cache" / "text" / digest / "meta.json").is_file()  # the default cache_dir
    assert load(corpus, tmp_path / "c", bpe_vocab=300)[2] != digest
    assert load(corpus, tmp_path / "c", bpe_vocab=400, val_fraction=0.2)[2] != digest
    corpus.write_text(corpus.read_text() + " More.")
    assert load(corpus, tmp_path / "c", bpe_vocab=400)[2] != digest


def test_a_folder_is_its_files_in_sorted_order_without_hidden_ones(tmp_path):
    root = tmp_path / "texts"
    (root / "b").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "b" / "two.txt").write_text(sentences(100, seed=2))
    (root / "a.txt").write_text(sentences(100, seed=1))
    (root / ".hidden.txt").write_text("secret words")
    (root / ".git" / "config").write_text("more secret words")
    (root / "empty.txt").write_text("")
    splits, tok, _ = load(root, tmp_path / "c", tokenizer="bytes", val_fraction=0.25)
    whole = sentences(100, seed=1) + "\n\n" + sentences(100, seed=2)
    joined = tok.decode(np.concatenate([splits["train"].tokens, splits["test"].tokens]))
    assert joined == whole and "secret" not in joined


@pytest.mark.parametrize("case, match", [
    ("missing", "nowhere.*no such file or folder"),
    ("empty folder", "no files"),
    ("empty files", "only empty files"),
    ("nul", "binary.txt: a binary file.*NUL"),
    ("latin-1", r"latin.txt: not UTF-8 text \(byte \d+ is not UTF-8; another encoding, such as Latin-1\?\): convert"),
    ("utf-16", r"utf16.txt: UTF-16 text, not UTF-8: convert it to UTF-8 \(iconv -f utf-16 -t utf-8\)"),
    ("short", "validation part has .* tokens.*needs 512.*smaller seq_len= or more text, or a larger val_fraction="),
    ("seq_len", "seq_len=0"),
    ("val_fraction", "val_fraction=1.0"),
    ("bpe_vocab", "bpe_vocab=70000: use 257 to 65536"),
    ("tokenizer file", "not-a-tokenizer.json: does not load"),
    ("tokenizer missing", "tokenizer=.*absent.json: cannot be read"),
    ("tokenizer without [UNK]", "words.json: cannot encode the text \\(WordLevel error: Missing \\[UNK\\] token"),
    ("empty vocabulary", "empty.json: its vocabulary holds 0 token\\(s\\)"),
])
def test_bad_input_is_one_line_that_names_it(tmp_path, corpus, case, match):
    kwargs = {}
    path = corpus
    if case == "missing":
        path = tmp_path / "nowhere"
    elif case in ("empty folder", "empty files"):
        path = tmp_path / "folder"
        (path / "sub").mkdir(parents=True)
        if case == "empty files":
            (path / "sub" / "a.txt").write_text("")
    elif case in ("nul", "latin-1", "utf-16"):
        path = tmp_path / "folder"
        path.mkdir()
        (path / "a.txt").write_text("fine")
        name, data = {"nul": ("binary.txt", b"text\0more"), "latin-1": ("latin.txt", "café".encode("latin-1")),
                      "utf-16": ("utf16.txt", "hello\r\n".encode("utf-16"))}[case]  # Windows's, with its BOM
        (path / name).write_bytes(data)
    elif case == "short":
        kwargs["seq_len"] = 256
    elif case == "seq_len":
        kwargs["seq_len"] = 0
    elif case == "val_fraction":
        kwargs["val_fraction"] = 1.0
    elif case == "bpe_vocab":
        kwargs["bpe_vocab"] = 70000
    elif case == "tokenizer file":
        (tmp_path / "not-a-tokenizer.json").write_text('{"model": 3}')
        kwargs["tokenizer"] = str(tmp_path / "not-a-tokenizer.json")
    elif case in ("tokenizer without [UNK]", "empty vocabulary"):  # a word-level tokenizer knowing 2 words, or none
        import tokenizers

        words = {"the": 0, "king": 1} if case == "tokenizer without [UNK]" else {}
        made = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="[UNK]"))
        made.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
        kwargs["tokenizer"] = str(tmp_path / ("words.json" if words else "empty.json"))
        made.save(kwargs["tokenizer"])
    else:
        kwargs["tokenizer"] = str(tmp_path / "absent.json")
    with pytest.raises(ConfigError, match=match) as caught:
        load(path, tmp_path / "c", **kwargs)
    assert "\n" not in str(caught.value)


def test_a_missing_tokenizers_package_says_how_to_install_it(tmp_path, corpus, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(errors.MissingExtra, match="tokenizers"):
        load(corpus, tmp_path / "c")
    assert load(corpus, tmp_path / "c", tokenizer="bytes")[1].vocab_size == 256  # bytes need no package
    with pytest.raises(ConfigError, match="no such file or folder"):  # the text first (a new user's finding: the
        load(tmp_path / "nowhere.txt", tmp_path / "c")                 # package was asked for a missing file)


def test_the_cache_record_says_what_it_holds(tmp_path, corpus):
    splits, _, digest = load(corpus, tmp_path / "c", tokenizer="bytes")
    meta = json.loads((tmp_path / "c" / digest / "meta.json").read_text())
    assert meta["train"] == len(splits["train"].tokens) and meta["dtype"] == "uint16" and meta["files"] == 1
