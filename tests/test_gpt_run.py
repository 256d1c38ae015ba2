"""A GPT trained from text as users start it (``python -m experiments.gpt``): it learns (its validation loss falls
below the unigram entropy of the same tokens) and samples text; a run resumed mid-epoch ends with the
uninterrupted run's params; 2 processes equal 1 and read each window once; bad settings are one line."""

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, reported_digests, run_cli

from jaxtrain.data import loader, text
from jaxtrain.driver import export, language
from jaxtrain.errors import ConfigError
from jaxtrain.kernels import onednn
from jaxtrain.models import gpt
from jaxtrain.pretrained import gpt2

GPT = ["-m", "experiments.gpt", "--no-progress", "--model-size", "tiny", "--seq-len", "16", "--tokenizer", "bytes",
       "--batch-size", "8"]


def sentences(n: int, seed: int) -> str:
    """``n`` sentences of a small grammar: text with structure a tiny model learns in a few hundred steps."""
    rng = np.random.default_rng(seed)
    who, did, what = ["the king", "a shepherd", "the people", "his son"], ["saw", "blessed", "heard", "followed"], [
        "the city", "the lord", "a great light", "the river"]
    return " ".join(f"{rng.choice(who).capitalize()} {rng.choice(did)} {rng.choice(what)}." for _ in range(n))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_text(sentences(400, 0))  # ~11,000 bytes: ~60 training windows of 16
    return path


def summary(out):
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus):
    """A finished run: 6 epochs of the tiny GPT on 2 devices (its process's output, its directory)."""
    out = tmp_path_factory.mktemp("gpt") / "run"
    run = run_cli(*GPT, "--dataset", f"text:{corpus}", "--devices", "2", "--epochs", "6", "--log-every", "20",
                  "--lr", "3e-3", "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    return run, out


def test_a_gpt_learns_the_text_says_its_perplexity_and_samples_from_it(trained):
    run, out = trained
    s = summary(out)
    assert s["test_loss"] < 0.7 * s["unigram_entropy"], (s["test_loss"], s["unigram_entropy"])  # it reads context
    assert s["tokens_per_sec"] == pytest.approx(16 * s["examples_per_sec"])
    assert s["test_perplexity"] == pytest.approx(np.exp(s["test_loss"]))
    # 2 CPU devices: the attention's products oneDNN's where its kernels build (CI's do), the blocks a loop
    dnn = onednn.available()
    assert (s["positions"], s["attention"], s["blocks"]) == ("learned", "onednn" if dnn else "xla", "loop")
    assert (s["steps_per_call"], s["data_on_device"]) == (1, False)  # auto, as a CPU resolves it (recorded)
    said = run.stdout + run.stderr
    words = "XLA's, its products oneDNN's" if dnn else "XLA's"
    assert ("16 tokens, vocabulary 256 (bytes), model size tiny, positions: learned, attention: "
            f"{words}, blocks: a loop") in said, said[-3000:]
    assert " tokens/s, data wait " in said and "(ppl " in said, said[-3000:]
    samples = [line.split("sample: ", 1)[1] for line in said.splitlines() if "sample: " in line]
    assert len(samples) == 3 and all(len(t) >= 12 for t in samples), samples  # a window's bytes, spaces joined
    assert "the text stops at the model's context" not in said  # its own samples fit it (a new user's finding)
    tokenizer = text.load_tokenizer(out / export.TOKENIZER)
    assert tokenizer.vocab_size == 256 and tokenizer.decode(tokenizer.encode("The king saw")) == "The king saw"
    meta, params, _ = export.load(out)  # the saved model reads back (its digest checked)
    assert meta["input_shape"] == [16] and meta["num_classes"] == 256 and params["stages"]["qkv"].shape[0] == 2


def test_sample_goes_on_from_a_prompt_greedy_alike_twice_and_seeded(trained):
    _, out = trained
    greedy = [run_cli(*command, str(out), "--prompt", "The king", "--temperature", "0", "--tokens", "8")
              for command in (["-m", "experiments.sample"], ["-m", "jaxtrain", "sample"])]  # the console's too
    assert all(g.returncode == 0 for g in greedy), greedy[0].stderr[-3000:]
    assert greedy[0].stdout == greedy[1].stdout and greedy[0].stdout.startswith("The king")
    assert len(greedy[0].stdout.rstrip("\n")) == len("The king") + 8  # bytes: a token a character
    seeded = run_cli("-m", "experiments.sample", str(out), "--prompt", "The king", "--samples", "2", "--tokens", "8",
                     "--temperature", "2")
    assert seeded.returncode == 0, seeded.stderr[-3000:]
    first, second = seeded.stdout.split("-" * 40 + "\n")[:2]
    assert first.startswith("The king") and second.startswith("The king") and first != second
    long = run_cli("-m", "jaxtrain", "sample", str(out), "--prompt", "The king", "--tokens", "100",  # past its context
                   "--temperature", "0")
    assert long.returncode == 0 and len(long.stdout.rstrip("\n")) == 16, long.stderr[-3000:]
    assert ("warning: the text stops at the model's context of 16 tokens: 8 new tokens after the prompt's 8, not "
            "100") in long.stderr, long.stderr[-3000:]


def test_a_runs_damaged_tokenizer_is_said_as_the_runs_not_a_flags(trained, tmp_path):
    # a new user's finding: sample said "--tokenizer ...: does not load", a flag it does not have
    import shutil

    _, out = trained
    run = shutil.copytree(out, tmp_path / "run")
    (run / export.TOKENIZER).write_text("{not json")
    with pytest.raises(ConfigError, match=r"run_dir=.*: its tokenizer.json is damaged \(does not load as a Hugging "
                                          r"Face tokenizer.json .*\); train it again$"):
        language.trained(run)


def test_sample_refuses_a_run_that_is_not_a_language_models(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model.json").write_text(json.dumps({"model": "lenet", "input_shape": [28, 28, 1], "num_classes": 10}))
    run = run_cli("-m", "experiments.sample", str(tmp_path))
    refused = "holds a lenet model, not a language model (train one with jaxtrain gpt or python -m experiments.gpt)"
    assert run.returncode == 2 and run.stderr.strip().endswith(refused), run.stderr
    empty = run_cli("-m", "experiments.sample", str(tmp_path), "--prompt", "")  # was the library's words on shapes
    assert empty.returncode == 2 and empty.stderr.strip().endswith(
        "argument --prompt: '': empty; leave --prompt out to start from a new line"), empty.stderr
    shown = run_cli("-m", "experiments.sample", "--help").stdout
    prompt = shown[shown.index("--prompt PROMPT  "):shown.index("--tokens TOKENS  ")]
    assert prompt.count("(default") == 1 and "(default: a new line;" in prompt and "compiled call)." in shown


def test_init_from_a_hugging_face_gpt2_starts_from_its_weights_and_exports_them_back(torch_python, tmp_path, corpus):
    """A random GPT2LMHeadModel of the tiny size (tests/torch_gpt2.py) as --init-from: a step at lr 1e-9 leaves
    the file's weights (within 1e-6), and export_weights writes them back in transformers' names."""
    hf = tmp_path / "hf"
    hf.mkdir()
    made = subprocess.run([torch_python, str(ROOT / "tests" / "torch_gpt2.py"), "make", str(hf), "256", "16", "2",
                           "2", "64"], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr[-3000:]
    file, out = hf / "hf" / "model.safetensors", tmp_path / "run"
    run = run_cli(*GPT, "--dataset", f"text:{corpus}", "--init-from", str(file), "--lr", "1e-9", "--max-steps", "1",
                  "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"{file}: loaded" in run.stdout + run.stderr
    config = dataclasses.replace(gpt.SIZES["tiny"], seq_len=16, vocab=256)
    want, (_, params, _) = gpt2.load(file, config), export.load(out)
    for path, w in jax_leaves(want):
        assert np.abs(np.asarray(params_at(params, path)) - w).max() < 1e-6, path
    back = run_cli("-m", "experiments.export_weights", str(out), str(tmp_path / "back.safetensors"))
    assert back.returncode == 0, back.stderr[-3000:]
    again = gpt2.load(tmp_path / "back.safetensors", config)
    for path, w in jax_leaves(again):
        np.testing.assert_array_equal(w, np.asarray(params_at(params, path)))
    timm = run_cli("-m", "experiments.export_weights", str(out), str(tmp_path / "t.safetensors"), "--names", "timm")
    assert timm.returncode == 2 and "--names timm: a gpt is written in Hugging Face's GPT-2 names: give --names hf " \
        "or leave it out" in timm.stderr, timm.stderr
    assert not (tmp_path / "t.safetensors").exists()  # it wrote GPT-2's names whatever was asked
    wrong = run_cli(*GPT, "--dataset", f"text:{corpus}", "--init-from", str(file), "--model-size", "mini",
                    "--max-steps", "1", "--out", str(tmp_path / "wrong"))
    assert wrong.returncode == 2 and "this GPT needs" in wrong.stderr, wrong.stderr[-3000:]


def test_a_rotary_gpt_trains_says_so_samples_and_keeps_its_positions(tmp_path, corpus):
    """--rotary: the run's first line and its saved settings say so, it samples (the KV cache's keys turned by
    their positions), resuming without it is refused, and GPT-2's file format (learned positions) is refused."""
    args, ck, out = [*GPT, "--dataset", f"text:{corpus}", "--max-steps", "4"], str(tmp_path / "ck"), tmp_path / "run"
    run = run_cli(*args, "--rotary", "--checkpoint-dir", ck, "--checkpoint-every", "2", "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "model size tiny, positions: rotary, attention" in run.stdout + run.stderr
    meta, params, _ = export.load(out)
    assert meta["settings"]["rotary"] is True and set(params["embed"]) == {"wte"}
    assert summary(out)["positions"] == "rotary"
    sample = run_cli("-m", "experiments.sample", str(out), "--prompt", "The king", "--temperature", "0",
                     "--tokens", "4")
    assert sample.returncode == 0 and sample.stdout.startswith("The king"), sample.stderr[-3000:]
    back = run_cli("-m", "experiments.export_weights", str(out), str(tmp_path / "x.safetensors"))
    assert back.returncode == 2 and len(back.stderr.strip().splitlines()) == 1, back.stderr[-3000:]
    assert "this GPT's are rotary (--rotary): only a GPT trained without --rotary goes to" in back.stderr
    learned = run_cli(*args, "--max-steps", "6", "--checkpoint-dir", ck, "--resume", "--out", str(tmp_path / "l"))
    assert learned.returncode == 2 and "rotary True -> not given" in learned.stderr, learned.stderr[-3000:]
    lenet = run_cli("-m", "experiments.lenet", "--rotary", "--max-steps", "1")
    assert lenet.returncode == 2 and "--rotary is for a language model's text" in lenet.stderr, lenet.stderr


def jax_leaves(tree, prefix=()):
    for k, v in tree.items():
        yield from (jax_leaves(v, (*prefix, k)) if isinstance(v, dict) else [((*prefix, k), v)])


def params_at(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def test_a_run_stopped_mid_epoch_and_resumed_ends_with_the_uninterrupted_digest(tmp_path, corpus):
    args = [*GPT, "--dataset", f"text:{corpus}", "--devices", "2", "--epochs", "1", "--tokenizer", "bpe",
            "--vocab-size", "300"]
    whole = run_cli(*args, "--out", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    ck = str(tmp_path / "ck")
    part = run_cli(*args, "--max-steps", "3", "--checkpoint-dir", ck, "--checkpoint-every", "3",
                   "--out", str(tmp_path / "part"))
    assert part.returncode == 0, part.stderr[-3000:]
    rest = run_cli(*args, "--checkpoint-dir", ck, "--resume", "--out", str(tmp_path / "rest"))
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert "resuming from step 3 (epoch 1, batch 3)" in rest.stdout + rest.stderr
    assert summary(tmp_path / "rest")["params_digest"] == summary(tmp_path / "whole")["params_digest"]
    other = run_cli(*args[:-2], "--vocab-size", "400", "--checkpoint-dir", ck, "--resume", "--out",
                    str(tmp_path / "other"))
    assert other.returncode == 2 and "vocab_size 300 -> 400" in other.stderr, other.stderr[-3000:]


@pytest.mark.slow
def test_two_processes_equal_one_process_with_two_devices(tmp_path, corpus):
    args = [*GPT, "--dataset", f"text:{corpus}", "--epochs", "1"]
    multi = run_cli("-m", "jaxtrain.launch", "--processes", "2", "--devices-per-process", "1", "--", sys.executable,
                    *args, "--out", str(tmp_path / "multi"))
    assert multi.returncode == 0, multi.stdout[-3000:]
    single = run_cli(*args, "--devices", "2", "--out", str(tmp_path / "single"))
    assert single.returncode == 0, single.stderr[-3000:]
    assert reported_digests(multi.stdout) == {summary(tmp_path / "single")["params_digest"]}  # bit for bit


def test_a_pipelined_gpt_trains_from_the_command_line_and_samples_in_layer_order(tmp_path, corpus):
    """Its blocks over 2 stages (the head tied to the embedding across them: tests/test_gpt_pipeline.py holds
    the steps to the unpipelined ones); sampling reads its per-stage blocks in layer order, and so does its saved
    model: experiments.sample and the export read it as an unpipelined run's. One saved per stage (before) is
    refused in one line."""
    out = tmp_path / "o"
    run = run_cli(*GPT, "--dataset", f"text:{corpus}", "--devices", "4", "--mesh", "data=2,stage=2",
                  "--microbatches", "2", "--max-steps", "3", "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    said = run.stdout + run.stderr
    assert "pipeline 2 stages x 2 micro-batches (gpipe" in said and said.count("sample: ") == 3, said[-3000:]
    meta, params, _ = export.load(out)  # the unpipelined model's shapes, checked against its digest
    assert params["stages"]["fc"].shape[0] == gpt.SIZES["tiny"].layers
    sampled = run_cli("-m", "experiments.sample", str(out), "--prompt", "the", "--tokens", "8", "--temperature", "0")
    assert sampled.returncode == 0 and len(sampled.stdout.strip()) > len("the"), sampled.stderr[-2000:]
    (out / export.INFO).write_text(json.dumps({k: v for k, v in meta.items() if k != export.LAYER_ORDER}))
    with pytest.raises(ConfigError, match="a pipelined run saved before its layers were put back in order"):
        export.info(out)


def test_each_process_reads_its_rows_of_each_window_batch_and_every_window_once_an_epoch(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text(sentences(200, 1))
    splits, _, _ = text.load(corpus, seq_len=16, tokenizer="bytes", cache_dir=tmp_path / "cache")
    split = splits["train"]
    whole = loader.Loader(split, 8, train=True, seed=3, process_index=0, process_count=1)
    halves = [loader.Loader(split, 8, train=True, seed=3, process_index=p, process_count=2) for p in (0, 1)]
    got = []
    for b in range(len(whole)):
        rows = [h.batch_at(1, b)["tokens"] for h in halves]
        assert all(len(r) == 4 for r in rows)
        np.testing.assert_array_equal(np.concatenate(rows), whole.batch_at(1, b)["tokens"])
        got += [w for r in rows for w in r]
    order = loader.epoch_order(len(split), 3, 1)[:len(got)]  # the epoch's windows, each once (a permutation)
    shifts = [s for s in range(16) if all(np.array_equal(w, split.tokens[i * 16 + s:i * 16 + s + 17])
                                          for i, w in zip(order, got))]
    assert len(shifts) == 1 and len(set(order)) == len(got) == len(whole) * 8, shifts  # one shift: windows tile


@pytest.mark.parametrize("args, says", [
    (["--dataset", "fashion_mnist"], "--model gpt with --dataset fashion_mnist: a language model trains on text"),
    (["--seq-len", "4000"], "a window of --seq-len 4000 needs 8000 (seq_len + 1 at any shift)"),
    (["--tokenizer", "missing.json"], "--tokenizer missing.json: not bpe or bytes, and no such file"),
    (["--tokenizer", "tests"], "--tokenizer tests: not bpe or bytes, and a directory (give the path of a "
                               "tokenizer.json)"),  # a new user's finding: it said "no such file"
])
def test_bad_settings_are_one_line_with_exit_2(tmp_path, corpus, args, says):
    run = run_cli(*GPT, "--dataset", f"text:{corpus}", *args, "--max-steps", "1", "--out", str(tmp_path / "o"))
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1, run.stderr[-3000:]
    assert says in run.stderr, run.stderr


def test_an_image_model_on_text_and_text_settings_on_images_are_refused(tmp_path, corpus):
    lenet = run_cli("-m", "experiments.lenet", "--dataset", f"text:{corpus}", "--max-steps", "1")
    assert lenet.returncode == 2 and "text is a language model's (gpt); lenet takes images" in lenet.stderr
    seq = run_cli("-m", "experiments.lenet", "--seq-len", "8", "--max-steps", "1")
    assert seq.returncode == 2 and "--seq-len is for a language model's text" in seq.stderr, seq.stderr


def test_text_stays_on_the_host_and_its_settings_refuse_what_text_has_not(corpus):
    """data_on_device auto keeps text's windows on the host even on a GPU (on: refused); classes=, data_dir=
    and a vocab_size for a tokenizer that has its own are one line; to_argv gives text runs back."""
    from jaxtrain import cli
    from jaxtrain.driver import busy
    from jaxtrain.driver.config import RunConfig
    from jaxtrain.errors import ConfigError

    split = text.TextSplit(np.zeros(100, np.uint16), 8, 256)
    assert busy.data_on_device("auto", "gpu", split, None) == (False, "auto: text's windows are cut on the host")
    with pytest.raises(ConfigError, match="text's windows are cut on the host"):
        busy.data_on_device("on", "gpu", split, None)
    dataset = f"text:{corpus}"
    for given, says in ((dict(classes="1,2"), "classes= is for image datasets"),
                        (dict(data_dir="/tmp"), "data_dir= is for image datasets"),
                        (dict(tokenizer="bytes", vocab_size=300), "vocab_size= is the BPE's"),
                        (dict(data_on_device="on"), "text's windows are cut on the host")):
        with pytest.raises(ConfigError, match=says):
            RunConfig(model="gpt", dataset=dataset, **given)
    assert RunConfig(model="gpt", dataset=dataset, tokenizer="bytes").vocab_size is None
    for given in (dict(model_size="124m", seq_len=128), dict(tokenizer="bytes"), dict(model_size="tiny"), {}):
        config = RunConfig(model="gpt", dataset=dataset, **given)
        assert cli.parse(cli.to_argv(config), model="gpt") == config, given


def test_a_tokenizer_files_own_truncation_and_padding_never_cut_the_token_stream(tmp_path, corpus):
    splits, bpe, _ = text.load(corpus, seq_len=16, tokenizer="bpe", bpe_vocab=300, cache_dir=tmp_path / "c")
    sample = sentences(200, 2)
    want = bpe.encode(sample)
    hf = bpe._hf
    hf.enable_truncation(64), hf.enable_padding(length=80)  # as many saved tokenizer.json files carry
    hf.save(str(tmp_path / "tokenizer.json"))
    np.testing.assert_array_equal(text.load_tokenizer(tmp_path / "tokenizer.json").encode(sample), want)
    assert len(want) > 80


def test_the_unigram_entropy_is_of_the_tokens_the_test_loss_predicts():
    from jaxtrain.driver import language

    split = text.TextSplit(np.arange(50, dtype=np.uint16) % 7, 8, 16)  # 50 tokens: 5 windows of 8 (+1)
    np.testing.assert_array_equal(language.targets(split), split.tokens[1:41])
    assert language.unigram_entropy(np.array([1, 1, 2, 2]), 4) == pytest.approx(np.log(2))


def test_a_log_line_says_the_mfu_where_the_devices_peak_is_known():
    """``step_log``: tokens/s from the examples' rate and the window; the MFU (3 x forward FLOPs per example x
    examples/s over the peak) beside it, only with a known peak (GPUs' datasheets, --measure-peak)."""
    import types

    from jaxtrain.driver import observe

    def line(peak, examples=400):
        said = []
        loop = types.SimpleNamespace(recent={"loss": np.float32(2.0)}, total_steps=10, call_size=1,
                                     sums={"examples": examples}, chrono=types.SimpleNamespace(
                                         train_sec=2.0, wait=0.0, start_up=0.0))
        observe.step_log(10, said.append, None, seq_len=16, flops_per_example=1e6, peak=peak).fn(loop)
        return said[0]

    assert line(6e8) == "step 9: loss 2.0000 (ppl 7.4), 3,200 tokens/s, MFU 100.0%, data wait 0%"  # 3e6 x 200/s
    assert line(1.2e9).endswith("3,200 tokens/s, MFU 50.0%, data wait 0%")
    assert "MFU" not in line(None)
    assert line(6e8, examples=0).endswith(", 0 tokens/s, data wait 0%")  # none since the last line (a resume's)
