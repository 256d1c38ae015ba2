"""How many decode cores keep the devices fed, the input-pipeline report on an image folder, and a run's word on
which side set its pace."""

import json

import pytest
from conftest import run_cli
from image_folders import make_folder

from jaxtrain.analysis.feeding import Feeding
from jaxtrain.driver.report import INPUT_BOUND, bottleneck, wait_words


def test_cores_needed_and_the_wait_to_expect():
    f = Feeding(per_core=250.0, demand=20_000.0, cores=16)
    assert f.needed == 80  # 20,000 / 250
    assert f.wait_share == pytest.approx(1 - 16 * 250 / 20_000)  # the devices run at the host's 4,000 images/s
    assert Feeding(250.0, 1_000.0, 4).wait_share == 0 and Feeding(250.0, 1_001.0, 4).needed == 5
    assert "need 80 cores. With 16: data wait ~80%" in f.format("8 x H100")
    with pytest.raises(ValueError):
        Feeding(0.0, 1.0, 1)


def test_a_run_names_the_input_pipeline_as_its_bottleneck_only_above_a_few_percent():
    assert bottleneck(INPUT_BOUND) == "step" and bottleneck(0.2) == "input pipeline"
    assert wait_words(0.01, 2) == "data wait 1.0%"
    assert wait_words(0.31, 2).startswith("data wait 31.0% (the input pipeline is the bottleneck, not the step: 2 "
                                          "worker(s); more --workers")


def test_the_folder_report_prints_rates_per_worker_and_the_cores_a_saved_gpu_plan_needs(tmp_path):
    root = make_folder(tmp_path / "d", {"train": 6, "val": 1}, size=(64, 48))
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"gpu": "h100", "gpus": 8, "hosts": 1, "call_batch": 2048, "estimate": {
        "examples_per_second": 60_000.0}, "settings": {"model": "resnet50", "precision": "bf16"}}))
    out = run_cli("-m", "experiments.input_pipeline", "--dataset", f"folder:{root}", "--image-size", "32",
                  "--batch-size", "6", "--batches", "2", "--workers", "1", "--gpu-plan", str(plan), "--cores", "4")
    assert out.returncode == 0, out.stderr[-2000:]
    row = next(line for line in out.stdout.splitlines() if line.startswith("| 1 |"))
    per_core = float(row.split("|")[2].replace(",", ""))
    expected = Feeding(per_core, 60_000.0, 4)
    assert (f"each host's 8 x h100 (resnet50, bf16, batch 2048, estimated) take 60,000 images/s; at {per_core:,.0f} "
            f"images/s per decode core they need {expected.needed} cores. With 4:") in out.stdout, out.stdout
    bad = run_cli("-m", "experiments.input_pipeline", "--dataset", f"folder:{root}", "--gpu-plan", str(root))
    assert bad.returncode == 2 and "not a plan of experiments.gpu_plan --json" in bad.stderr
