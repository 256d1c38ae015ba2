"""Training runs on image folders, as users start them: 2 processes equal 1, a run resumed mid-epoch equals an
uninterrupted one (worker processes decoding), memory bounded by the workers' buffers, bad folders in one line."""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, reported_digests, run_cli
from image_folders import make_folder, noise
from PIL import Image

pytestmark = pytest.mark.slow

LENET = ["-m", "experiments.lenet", "--no-progress", "--batch-size", "16", "--workers", "2"]


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """90 training images (5 steps of 16 an epoch), 12 to evaluate; sizes and formats mixed."""
    return make_folder(tmp_path_factory.mktemp("folder") / "d", {"train": 30, "val": 4})


def summary(out):
    return json.loads((out / "summary.json").read_text())


def test_two_processes_equal_one_process_with_two_devices(tmp_path, images):
    args = [*LENET, "--dataset", f"folder:{images}", "--epochs", "2"]
    multi = run_cli("-m", "jaxtrain.launch", "--processes", "2", "--devices-per-process", "1", "--", sys.executable,
                    *args, "--out", str(tmp_path / "multi"))
    assert multi.returncode == 0, multi.stdout[-3000:]
    single = run_cli(*args, "--devices", "2", "--summary", "--out", str(tmp_path / "single"))  # the summary decodes
    assert single.returncode == 0, single.stderr[-3000:]
    assert reported_digests(multi.stdout) == {summary(tmp_path / "single")["params_digest"]}  # bit for bit
    s = summary(tmp_path / "single")
    assert s["class_names"] == ["cat", "dog", "ship"] and (s["train_examples"], s["test_examples"]) == (90, 12)
    model = json.loads((tmp_path / "single" / "model.json").read_text())
    assert model["class_names"] == ["cat", "dog", "ship"] and model["input_shape"] == [32, 32, 3]


def test_processes_that_read_different_folders_stop_in_one_line_naming_the_first(tmp_path):
    """Each node's copy of a folder must be the same: process 1's lacks a file, so both processes stop before
    training, with the same one line (not a run of silently mixed data)."""
    for rank, per_class in enumerate(({"train": 6, "val": 2}, {"train": 5, "val": 2})):
        make_folder(tmp_path / f"d{rank}", per_class)
    command = (f"exec {sys.executable} {' '.join(LENET)} --dataset folder:{tmp_path}/d$JAXTRAIN_PROCESS_ID "
               "--max-steps 1")
    run = run_cli("-m", "jaxtrain.launch", "--processes", "2", "--devices-per-process", "1", "--", "sh", "-c",
                  command)
    assert run.returncode != 0
    errors = [line.split("] ", 1)[-1] for line in run.stdout.splitlines() if "error:" in line]
    assert errors and all(e == errors[0] for e in errors), run.stdout[-3000:]
    assert errors[0].startswith("python -m experiments.lenet: error: process 1 on ")
    assert "has other data than process 0 on " in errors[0]
    assert errors[0].endswith("every process must read the same dataset (a folder copied whole to each node, or "
                              "one shared folder)"), errors[0]


def test_a_run_stopped_mid_epoch_and_resumed_ends_with_the_uninterrupted_digest(tmp_path, images):
    args = [*LENET, "--dataset", f"folder:{images}", "--devices", "2", "--epochs", "2", "--augment", "crop+flip"]
    whole = run_cli(*args, "--out", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    ck = str(tmp_path / "ck")
    part = run_cli(*args, "--max-steps", "3", "--checkpoint-dir", ck, "--checkpoint-every", "3",
                   "--out", str(tmp_path / "part"))
    assert part.returncode == 0, part.stderr[-3000:]
    rest = run_cli(*args, "--checkpoint-dir", ck, "--resume", "--out", str(tmp_path / "rest"))
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert "resuming from step 3 (epoch 1, batch 3)" in rest.stdout, rest.stdout
    assert summary(tmp_path / "rest")["params_digest"] == summary(tmp_path / "whole")["params_digest"]


def test_memory_stays_bounded_on_a_folder_several_times_larger_than_the_process(tmp_path):
    """1,600 links to one 1.7 MB photograph-sized JPEG (1600x1200 of noise: no decoder shortcut) are 2.7 GB of
    files; the run's largest process (the trainer or a worker) must stay under a third of that."""
    root = tmp_path / "big"
    Image.fromarray(noise((1200, 1600, 3), 7)).save(tmp_path / "photo.jpg", quality=90)
    for split, n in (("train", 800), ("val", 8)):
        for c in ("a", "b"):
            (root / split / c).mkdir(parents=True)
            for i in range(n):
                os.link(tmp_path / "photo.jpg", root / split / c / f"{i}.jpg")
    folder_bytes = sum(p.stat().st_size for p in root.rglob("*.jpg"))
    script = tmp_path / "measured.py"
    script.write_text("import resource, sys\nfrom jaxtrain.cli import main\n\nif __name__ == '__main__':\n"
                      "    code = main('lenet', sys.argv[1:])\n"
                      "    print('maxrss', max(resource.getrusage(who).ru_maxrss for who in "
                      "(resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)) * 1024)\n    sys.exit(code)\n")
    run = run_cli(str(script), *LENET[2:], "--dataset", f"folder:{root}", "--devices", "2", "--epochs", "1",
                  "--batch-size", "32", "--out", str(tmp_path / "out"))
    assert run.returncode == 0, run.stderr[-3000:]
    peak = int(run.stdout.split("maxrss ")[1].split()[0])
    assert summary(tmp_path / "out")["train_examples"] == 1600
    assert folder_bytes > 3 * peak, (folder_bytes, peak)


@pytest.mark.parametrize("layout, says", [("missing", "not a directory"), ("flat", "pass --val-fraction")])
def test_a_folder_that_cannot_be_used_is_one_line_with_exit_2(tmp_path, layout, says):
    root = tmp_path / "d"
    if layout == "flat":
        make_folder(root, {"": 2})
    run = run_cli(*LENET, "--dataset", f"folder:{root}", "--max-steps", "1", "--out", str(tmp_path / "o"))
    assert run.returncode == 2 and says in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr


def test_rrc_flip_trains_resnet50_on_a_folder_at_its_own_size(tmp_path):
    root = make_folder(tmp_path / "d", {"train": 6, "val": 1}, size=(300, 260))
    run = run_cli("-m", "jaxtrain.cli", "--model", "resnet50", "--no-progress", "--dataset",
                  f"folder:{root}", "--devices", "2", "--max-steps", "2", "--batch-size", "4", "--workers", "1",
                  "--out", str(tmp_path / "o"))
    assert run.returncode == 0, run.stderr[-3000:]
    s = summary(tmp_path / "o")
    model = json.loads((tmp_path / "o" / "model.json").read_text())
    assert model["settings"]["augment"] == "rrc+flip" and model["input_shape"] == [224, 224, 3]
    assert np.isfinite(s["train_loss"])


CTRL_C_WHILE_A_WORKER_STARTS = '''import os, signal, sys
from jaxtrain.cli import main

if __name__ == "__mp_main__":  # a grain worker process, importing this module as it starts
    n = 0  # this worker's number in the order they started: the first file it creates (two start at once: "x" is
    while True:  # atomic, so the one that loses a number takes the next)
        try:
            open(os.path.join(os.environ["STARTED"], str(n)), "x").close()
            break
        except FileExistsError:
            n += 1
    if n == int(os.environ["CTRL_C_AT"]):
        os.killpg(0, signal.SIGINT)  # as a terminal's Ctrl-C: to every process of the group
if __name__ == "__main__":
    sys.exit(main("lenet", sys.argv[1:]))
'''


def test_ctrl_c_while_the_evaluations_workers_start_saves_and_stops_cleanly(tmp_path, images):
    """Issue 64: a Ctrl-C at an epoch's end, while the evaluation's worker processes were importing, killed them:
    grain's "Worker process was terminated unexpectedly", 110 lines of traceback, exit 1, nothing saved. Here the
    evaluation's first worker (the third to start: the training's two started before) sends it itself."""
    script, started = tmp_path / "ctrl_c.py", tmp_path / "started"
    script.write_text(CTRL_C_WHILE_A_WORKER_STARTS)
    started.mkdir()
    env = {**os.environ, "STARTED": str(started), "CTRL_C_AT": "2", "PYTHONPATH": str(ROOT)}  # this jaxtrain
    env.pop("JAX_NUM_CPU_DEVICES", None)
    run = subprocess.run([sys.executable, str(script), *LENET[2:], "--dataset", f"folder:{images}", "--devices", "2",
                          "--epochs", "2", "--log-every", "1", "--checkpoint-every", "5", "--checkpoint-dir",
                          str(tmp_path / "ck"), "--out", str(tmp_path / "o")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, start_new_session=True)
    assert sorted(os.listdir(started)) == ["0", "1", "2", "3"], run.stderr[-3000:]  # the evaluation's started
    assert run.returncode == 130, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    assert f"checkpoint saved in {tmp_path / 'ck'}" in run.stdout, run.stdout
    assert "leaked shared_memory" not in run.stderr, run.stderr[-3000:]


def test_a_run_with_workers_stopped_by_a_signal_leaves_no_shared_memory_behind(tmp_path, images):
    """Issue 64: after a signal (or an error) with worker processes, Python's resource_tracker warned at exit of
    "leaked shared_memory objects" (batches grain had made, unlinked by nobody before the exit)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("JAX_NUM_CPU_DEVICES", None)
    proc = subprocess.Popen([sys.executable, *LENET, "--dataset", f"folder:{images}", "--devices", "2", "--epochs",
                             "2", "--log-every", "1", "--out", str(tmp_path / "o")],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:  # mid-epoch: batches in the workers' buffers and on their way
        if line.startswith("step 2:"):
            break
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 143 and "stopped by signal" in out, err[-3000:]
    assert "resource_tracker" not in err and "leaked shared_memory" not in err, err[-3000:]
