"""Weights from torchvision and timm into jaxtrain's ResNets and back (jaxtrain.pretrained): the same network,
checked against PyTorch itself (tests/torch_reference.py, in a Python with torch: ``make torch-venv``)."""

import io
import math
import os
import re
import sys

import jax
import numpy as np
import optax
import pytest

import jaxtrain as jt
from jaxtrain import models, pretrained
from jaxtrain.errors import ConfigError
from jaxtrain.pretrained import tensors
from torch_side import made_fixture, reference, relative

SIZE = 64  # small images: the networks are the ImageNet ones, their maps shrink to 2x2 at the end


made = made_fixture(SIZE)


def model(name: str, classes: int):
    return models.get(name, input_shape=(SIZE, SIZE, 3), num_classes=classes, conv="xla")


PAIRS = [("resnet18", "resnet18_imagenet"), ("resnet50", "resnet50"), ("timm_resnet18", "resnet18_imagenet"),
         ("timm_resnet50", "resnet50")]


@pytest.mark.parametrize("arch, name, file", [
    pytest.param(arch, name, file, marks=[pytest.mark.slow] * (arch != "resnet18" or file != "weights.pth"))
    for arch, name in PAIRS for file in ("weights.pth", "weights.safetensors")])  # the newest-JAX leg: one
def test_imported_weights_give_torchs_logits(made, arch, name, file):
    out = made(arch, 7)
    loaded = pretrained.load(out / file, into=model(name, 7))
    assert loaded.replaced == () and set(n.rsplit(".", 1)[-1] for n in loaded.unused) == {"num_batches_tracked"}
    logits = model(name, 7).logits(*loaded.variables, np.load(out / "x.npy"))
    assert relative(logits, np.load(out / "logits.npy")) < 1e-4


@pytest.mark.parametrize("mesh, strategy", [(1, "jit"), (2, "jit"), (2, "shard_map")])
def test_a_training_step_updates_the_batchnorm_statistics_as_torch_does(made, mesh, strategy):
    """One SGD step (lr 0.1) in training mode: the running means and variances (PyTorch's: the batch's unbiased
    variance) equal torch's, over the whole batch however the step splits it."""
    out = made("resnet18", 7)
    net = model("resnet18_imagenet", 7)
    variables = pretrained.load(out / "weights.safetensors", into=net).variables
    trainer = jt.make_train_step(net.loss_fn, optax.sgd(0.1), mesh=mesh, strategy=strategy)
    state = trainer.init(init_fn=lambda rng: variables, rng=jax.random.key(0))
    batch = {"image": np.load(out / "x.npy"), "label": np.load(out / "y.npy").astype(np.int32)}
    state, _ = trainer(state, trainer.shard(batch))
    mine = pretrained.export("resnet18_imagenet", *jax.device_get((state.params, state.model_state)))
    theirs = tensors.read(out / "after.safetensors")
    for name in (n for n in theirs if n.endswith(("running_mean", "running_var"))):
        assert relative(mine[name], theirs[name]) < 1e-5, name


def test_another_class_count_gets_the_models_own_classifier_saying_so(made):
    out = made("resnet50", 7)
    loaded = pretrained.load(out / "weights.safetensors", into=model("resnet50", 3), seed=1)
    assert loaded.replaced == ("fc.bias (7 -> 3)", "fc.weight (7x2048 -> 3x2048)")
    fresh = jax.tree.map(np.asarray, model("resnet50", 3).init(jax.random.key(1)))
    np.testing.assert_array_equal(loaded.params["dense"]["kernel"], fresh[0]["dense"]["kernel"])
    np.testing.assert_array_equal(loaded.params["stem"]["kernel"],
                                  tensors.read(out / "weights.safetensors")["conv1.weight"].transpose(2, 3, 1, 0))
    assert loaded.summary("w") == ("w: loaded; replaced fc.bias (7 -> 3), fc.weight (7x2048 -> 3x2048); unused: "
                                   "num_batches_tracked x53")
    by_name = pretrained.load(out / "weights.safetensors", into="resnet50")  # the file's 7 classes, 224x224
    assert by_name.params["dense"]["kernel"].shape == (2048, 7) and by_name.replaced == ()


@pytest.mark.parametrize("arch, name", [("resnet18", "resnet18_imagenet"),
                                        pytest.param("resnet50", "resnet50", marks=pytest.mark.slow)])
def test_exported_weights_load_into_torchvision_with_the_same_logits(made, torch_python, tmp_path, arch, name):
    out = made(arch, 7)
    net = model(name, 7)
    variables = pretrained.load(out / "weights.pth", into=net, seed=0).variables
    path = tensors.write(pretrained.export(name, *variables), tmp_path / "back.safetensors")
    reference(torch_python, "check", arch, 7, SIZE, out, path)  # load_state_dict(strict=True)
    assert relative(np.load(out / "checked.npy"), net.logits(*variables, np.load(out / "x.npy"))) < 1e-4


def test_bad_files_and_models_are_one_line_naming_what(made, tmp_path):
    out = made("resnet18", 7)
    whole = tensors.read(out / "weights.safetensors")
    tensors.write({k: v for k, v in whole.items() if k != "layer2.1.conv1.weight"}, tmp_path / "missing.safetensors")
    with pytest.raises(ConfigError, match=r"no tensor layer2.1.conv1.weight \(for resnet18_imagenet's "
                                          r"blocks/3/conv1/kernel\): is it a torchvision or timm resnet18 file\?"):
        pretrained.load(tmp_path / "missing.safetensors", into=model("resnet18_imagenet", 7))
    with pytest.raises(ConfigError, match=r"no tensor layer1.0.bn3.bias \(for resnet50's blocks/0/bn3/bias\): is it "
                                          r"a torchvision or timm resnet50 file\?"):
        pretrained.load(out / "weights.pth", into=model("resnet50", 7))  # ResNet-18's file in a ResNet-50
    shrunk = {**whole, "layer1.0.conv1.weight": whole["layer1.0.conv1.weight"][:32]}
    tensors.write(shrunk, tmp_path / "shape.safetensors")
    with pytest.raises(ConfigError, match=r"layer1.0.conv1.weight is 32x64x3x3, resnet18_imagenet needs 64x64x3x3 "
                                          r"there: another network\?"):
        pretrained.load(tmp_path / "shape.safetensors", into=model("resnet18_imagenet", 7))
    (tmp_path / "text.pth").write_text("not a checkpoint")
    with pytest.raises(ConfigError, match=r"text.pth: not PyTorch's zip format"):
        pretrained.load(tmp_path / "text.pth", into="resnet50")
    with pytest.raises(ConfigError, match=r"weights.npz: not a checkpoint jaxtrain reads"):
        pretrained.load(tmp_path / "weights.npz", into="resnet50")
    with pytest.raises(ConfigError, match=r"model lenet: pretrained weights are read and written for "
                                          "resnet18_imagenet, resnet50"):
        pretrained.load(out / "weights.pth", into="lenet")


def test_a_pytorch_file_is_read_without_torch_and_runs_no_code(tmp_path):
    """The unpickler allows tensors and dicts only: a pickle that would call os.system is refused."""
    import pickle
    import zipfile

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "ran"),))

    with zipfile.ZipFile(tmp_path / "evil.pth", "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps({"x": Evil()}))
    with pytest.raises(ConfigError, match=r"evil.pth: not a PyTorch state_dict \(UnpicklingError: posix.system is "
                                          r"not part of a state_dict\)"):
        tensors.read(tmp_path / "evil.pth")
    assert not (tmp_path / "ran").exists()


@pytest.mark.slow
def test_a_finished_runs_model_goes_back_to_torchvision_with_its_logits(torch_python, tmp_path):
    from conftest import run_cli
    from image_folders import make_folder

    from jaxtrain.driver import export

    root = make_folder(tmp_path / "d", {"train": 4, "val": 1})
    run = run_cli("-m", "jaxtrain.cli", "--model", "resnet18_imagenet", "--dataset", f"folder:{root}", "--image-size",
                  "32", "--batch-size", "4", "--max-steps", "2", "--devices", "2", "--no-progress",
                  "--out", str(tmp_path / "run"))
    assert run.returncode == 0, run.stderr[-3000:]
    path = tmp_path / "back.safetensors"
    wrote = run_cli("-m", "experiments.export_weights", str(tmp_path / "run"), str(path))  # save_pretrained
    assert wrote.returncode == 0 and wrote.stdout.strip() == f"wrote {path}", wrote.stderr[-2000:]
    np.save(tmp_path / "x.npy", np.random.default_rng(1).random((2, 32, 32, 3), dtype=np.float32))
    reference(torch_python, "check", "resnet18", 3, 32, tmp_path, path)
    meta, params, model_state = export.load(tmp_path / "run")
    ours = export.model_of(meta).logits(params, model_state, np.load(tmp_path / "x.npy"))
    assert relative(np.load(tmp_path / "checked.npy"), ours) < 1e-4


@pytest.mark.slow
def test_init_from_starts_a_run_from_the_files_weights_and_says_what_it_loaded(made, tmp_path):
    """--init-from: the run starts from the file's weights (one step at lr 1e-30 leaves them as they were), its
    first line says what it loaded and replaced; a model that takes no such file is one line (exit 2)."""
    from conftest import run_cli
    from image_folders import make_folder

    from jaxtrain.driver import export

    out = made("resnet18", 7)
    root = make_folder(tmp_path / "d", {"train": 4, "val": 1})  # 3 classes: the classifier starts afresh
    args = ["-m", "jaxtrain.cli", "--model", "resnet18_imagenet", "--dataset", f"folder:{root}", "--image-size", "64",
            "--batch-size", "4", "--max-steps", "1", "--lr", "1e-30", "--devices", "2", "--no-progress"]
    run = run_cli(*args, "--init-from", str(out / "weights.pth"), "--out", str(tmp_path / "run"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert (f"{out / 'weights.pth'}: loaded; replaced fc.bias (7 -> 3), fc.weight (7x512 -> 3x512); unused: "
            "num_batches_tracked x20") in run.stdout
    meta, params, model_state = export.load(tmp_path / "run")
    source = tensors.read(out / "weights.pth")
    np.testing.assert_allclose(params["conv"]["kernel"], source["conv1.weight"].transpose(2, 3, 1, 0), rtol=1e-6)
    assert meta["settings"]["init_from"] == str(out / "weights.pth")
    wrong = run_cli("-m", "experiments.resnet18", "--init-from", str(out / "weights.pth"), "--max-steps", "1")
    assert wrong.returncode == 2 and wrong.stderr.strip().splitlines()[-1] == (
        "python -m experiments.resnet18: error: model resnet18: pretrained weights are read and written for "
        "resnet18_imagenet, resnet50, vit_tiny, vit_small, vit_base (torchvision's and timm's ResNets, timm's and "
        "Hugging Face's ViTs): torchvision's ResNet-18 is resnet18_imagenet (resnet18 is d2l's)")


@pytest.fixture
def crafted(tmp_path, monkeypatch):
    """``(Tensor, read)``: ``Tensor(size, stride, offset=0, numel=4)`` pickled as torch names it, and ``read``, which
    writes ``{"w": tensor}`` over a storage of 4 floats (0..3) to t.pth and reads it back, with no torch at all."""
    import pickle
    import types
    import zipfile

    torch, utils = types.ModuleType("torch"), types.ModuleType("torch._utils")

    def _rebuild_tensor_v2(*args):
        return None

    class FloatStorage:
        pass

    _rebuild_tensor_v2.__module__, FloatStorage.__module__ = "torch._utils", "torch"
    _rebuild_tensor_v2.__qualname__, FloatStorage.__qualname__ = "_rebuild_tensor_v2", "FloatStorage"
    utils._rebuild_tensor_v2, torch.FloatStorage = _rebuild_tensor_v2, FloatStorage

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return obj if isinstance(obj, tuple) and obj[:1] == ("storage",) else None

    class Tensor:
        def __init__(self, size, stride, offset=0, numel=4):
            self.args = (("storage", FloatStorage, "0", "cpu", numel), offset, size, stride, False, None)

        def __reduce__(self):
            return _rebuild_tensor_v2, self.args

    def read(tensor):
        buf = io.BytesIO()
        with monkeypatch.context() as m:  # pickled as torch would name them; read with no torch at all
            m.setitem(sys.modules, "torch", torch)
            m.setitem(sys.modules, "torch._utils", utils)
            Pickler(buf).dump({"w": tensor})
        with zipfile.ZipFile(tmp_path / "t.pth", "w") as z:
            z.writestr("archive/data.pkl", buf.getvalue())
            z.writestr("archive/data/0", np.arange(4, dtype=np.float32).tobytes())
        return tensors.read(tmp_path / "t.pth")["w"]

    return Tensor, read


def test_a_pytorch_file_cannot_read_outside_its_storage(crafted):
    """Crafted tensors (a size past the storage, a negative stride, an offset past the end, a storage shorter
    than it says) are one line each: never bytes from around the buffer, never a crash."""
    Tensor, read = crafted
    np.testing.assert_array_equal(read(Tensor((2, 2), (2, 1))), [[0, 1], [2, 3]])
    for tensor, says in ((Tensor((64,), (1,)), "a tensor reaching element 63 of a storage of 4"),
                         (Tensor((10**8,), (1,)), "a tensor reaching element 99999999"),
                         (Tensor((4,), (-1,), 3), "a tensor whose storage, offset, size or stride is not a tensor's"),
                         (Tensor((1,), (1,), 10), "a tensor reaching element 10"),
                         (Tensor((4,), (1,), 0, 100), "storage 0 holds 16 bytes, not 100 elements")):
        with pytest.raises(ConfigError, match=r"t.pth: not a PyTorch state_dict \(UnpicklingError: " + says):
            read(tensor)


def test_a_pytorch_tensor_with_more_elements_than_its_storage_is_refused_by_name_before_it_is_copied(crafted):
    """A zero stride and a huge size stays inside the storage, yet its copy would be as large as the size says
    (2**40 floats: 4 TB from a file of 16 bytes): refused in one line naming it. A zero stride that repeats
    nothing (an expanded dimension of 1, as Hugging Face's ``position_ids``) is read."""
    Tensor, read = crafted
    np.testing.assert_array_equal(read(Tensor((1, 4), (0, 1))), [[0, 1, 2, 3]])
    np.testing.assert_array_equal(read(Tensor((2, 2), (0, 1))), [[0, 1], [0, 1]])  # no more than the file holds
    for size, stride in (((2**40,), (0,)), ((2, 4), (0, 1)), ((3, 2), (1, 1))):
        says = (f"t.pth: tensor 'w' has {math.prod(size)} elements, more than the 4 its storage holds (a zero or "
                "overlapping stride, as torch's expand() makes): save it with .contiguous(), or .clone(), before "
                "torch.save")
        with pytest.raises(ConfigError, match=re.escape(says) + "$"):
            read(Tensor(size, stride))


def test_safetensors_are_read_here_bfloat16_too_and_a_damaged_header_is_one_line(tmp_path):
    import json
    import struct

    import ml_dtypes

    weights = np.arange(6, dtype=np.float32).reshape(2, 3)
    body = weights.astype(ml_dtypes.bfloat16).tobytes() + np.array([7], np.int64).tobytes()
    header = json.dumps({"w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]},
                         "n": {"dtype": "I64", "shape": [], "data_offsets": [12, 20]},
                         "__metadata__": {"format": "pt"}}).encode()
    (tmp_path / "bf16.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + body)
    read = tensors.read(tmp_path / "bf16.safetensors")
    assert read["w"].dtype == np.float32 and np.array_equal(read["w"], weights) and int(read["n"]) == 7
    bad = json.dumps({"w": {"dtype": "F32", "shape": [100], "data_offsets": [0, 400]}}).encode()
    (tmp_path / "bad.safetensors").write_bytes(struct.pack("<Q", len(bad)) + bad + bytes(8))
    with pytest.raises(ConfigError, match=r"bad.safetensors: not a safetensors file \(ValueError: w's bytes 0:400 "
                                          r"do not hold float32 \(100,\)\)"):
        tensors.read(tmp_path / "bad.safetensors")


def test_an_older_resnet50_run_is_refused_not_misread():
    """resnet50 became torchvision's network (normalised inputs, unbiased running variance): a run or checkpoint
    of the earlier one is refused in one line; the other models' runs are as they were."""
    assert models.revision_settings("resnet50") == {"model_revision": 2} and models.revision_settings("lenet") == {}
    models.check_revision("resnet50", {"model_revision": 2}, "x")
    models.check_revision("lenet", {}, "x")
    with pytest.raises(ConfigError, match=r"^this run's model holds resnet50 revision 1; jaxtrain's resnet50 is now "
                                          r"revision 2 \(its inputs normalised with ImageNet's mean and std, .*\): "
                                          r"train it anew$"):
        models.check_revision("resnet50", {}, "this run's model")


@pytest.mark.parametrize("dtype", ["int8", "uint8", "float16"])
def test_integer_weights_are_refused_and_a_conversion_is_said(tmp_path, dtype):
    """Issue 64: a file whose float tensors were cast to int8 or uint8 loaded as weights, saying only "loaded;
    unused: num_batches_tracked x20". Integers where floats belong are one line; float16 loads, said so."""
    net = model("resnet18_imagenet", 3)
    weights = pretrained.export(net.name, *net.init(jax.random.key(0)))
    floats = [k for k, v in weights.items() if v.dtype == np.float32]
    tensors.write({k: v.astype(dtype) if k in floats else v for k, v in weights.items()}, tmp_path / "w.safetensors")
    if dtype == "float16":
        loaded = pretrained.load(tmp_path / "w.safetensors", into=net)
        assert loaded.summary("w") == (f"w: loaded; converted float16 -> float32 ({len(floats)} tensors); unused: "
                                       "num_batches_tracked x20")
        return
    with pytest.raises(ConfigError, match=rf"w.safetensors: [a-z0-9.]+\.(weight|bias) is {dtype}, resnet18_imagenet "
                                          r"needs floating-point numbers there: a quantized or cast file\? give its "
                                          r"float weights \(float32, float16 or bfloat16\)$"):
        pretrained.load(tmp_path / "w.safetensors", into=net)
