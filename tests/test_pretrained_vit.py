"""Weights from timm's and Hugging Face's ViTs into jaxtrain's ``vit_tiny`` and back (jaxtrain.pretrained): the
same network, checked against PyTorch itself (tests/torch_reference.py, in a Python with torch: ``make
torch-venv``). The first leg runs them all; the newest-JAX leg (not slow) one comparison with torch."""

import jax
import numpy as np
import pytest

from jaxtrain import models, pretrained
from jaxtrain.errors import ConfigError
from jaxtrain.pretrained import tensors
from jaxtrain.pretrained.vit import resample_matrix
from torch_side import made_fixture, reference, relative

SIZE = 64  # 4x4 patches of 16x16: ViT-Tiny's network at a size a CPU runs quickly
TIMM = "timm_vit_tiny_patch16_224"


made = made_fixture(SIZE)


def vit(classes: int, size: int | tuple = SIZE, name: str = "vit_tiny"):
    h, w = (size, size) if isinstance(size, int) else size
    return models.get(name, input_shape=(h, w, 3), num_classes=classes)


@pytest.mark.parametrize("arch, file", [(TIMM, "weights.safetensors"),  # the newest-JAX leg (not slow): this one
                                        pytest.param(TIMM, "weights.pth", marks=pytest.mark.slow),
                                        pytest.param("hf_vit_tiny", "weights.safetensors", marks=pytest.mark.slow)])
def test_imported_vit_weights_give_torchs_logits(made, arch, file):
    """timm's ViT-Tiny/16 (one qkv matrix) and transformers' ViTForImageClassification (q, k and v apart; its layer
    norms' eps 1e-12 where timm's and jaxtrain's is 1e-6): every tensor used, the logits torch's."""
    out = made(arch, 7)
    loaded = pretrained.load(out / file, into=vit(7))
    assert loaded.replaced == () and loaded.unused == () and loaded.resampled == ()
    logits = vit(7).logits(*loaded.variables, np.load(out / "x.npy"))
    assert relative(logits, np.load(out / "logits.npy")) < 1e-4


@pytest.mark.slow
def test_a_vit_model_without_classifier_gives_its_class_tokens_features(made):
    """transformers' ViTModel: no classifier (the model's own, said), its pooler unused; with an identity head
    the logits are the last hidden state's class token after the final layer norm, as torch computes it."""
    out = made("hf_vit_tiny_model", 192)
    net = vit(192)
    loaded = pretrained.load(out / "weights.safetensors", into=net)
    assert loaded.replaced == ("classifier.bias (none there)", "classifier.weight (none there)")
    assert loaded.unused == ("pooler.dense.bias", "pooler.dense.weight")
    assert loaded.summary("w") == ("w: loaded; replaced classifier.bias (none there), classifier.weight (none there); "
                                   "unused: pooler.dense.bias, pooler.dense.weight")
    params = {**loaded.params, "head": {**loaded.params["head"], "w": np.eye(192, dtype=np.float32),
                                        "b": np.zeros(192, np.float32)}}
    features = net.logits(params, {}, np.load(out / "x.npy"))
    assert relative(features, np.load(out / "logits.npy")) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("new, grid", [("96", "6x6"), ("32", "2x2"), ("32x96", "2x6")])
def test_the_position_embedding_is_resampled_for_another_image_size_as_timm_does(made, torch_python, new, grid):
    """A 64x64 model's weights (4x4 patches) in a larger, a smaller and an oblong model: the grid resampled
    bicubically, antialiased, each axis by its own scale, the class token's embedding kept; the logits those of
    timm's model made for that size from the same file through timm's own checkpoint filter. (A grid of as many
    patches in another shape, 2x8, is resampled too; timm's filter does that only when it knows the file's image
    size, which a bare file does not say.)"""
    out = made(TIMM, 7)
    reference(torch_python, "resample", TIMM, 7, SIZE, out, new)
    size = tuple(int(side) for side in new.split("x")) * (1 if "x" in new else 2)
    loaded = pretrained.load(out / "weights.safetensors", into=vit(7, size))
    assert loaded.resampled == (f"resampled pos_embed (4x4 -> {grid} patches)",)
    assert loaded.summary("w") == f"w: loaded; resampled pos_embed (4x4 -> {grid} patches)"
    oblong = pretrained.load(out / "weights.safetensors", into=vit(7, (32, 128)))
    assert oblong.resampled == ("resampled pos_embed (4x4 -> 2x8 patches)",)
    logits = vit(7, size).logits(*loaded.variables, np.load(out / f"x_{new}.npy"))
    assert relative(logits, np.load(out / f"resampled_{new}.npy")) < 1e-4


def test_the_resampling_weights_are_pytorchs_antialiased_bicubic():
    """Each row sums to 1; upsampling by 2 puts Keys' a=-0.5 weights on 4 taps (PIL's and PyTorch's aa filter);
    the same size is the identity."""
    np.testing.assert_allclose(resample_matrix(5, 5), np.eye(5), atol=1e-12)
    up, down = resample_matrix(4, 8), resample_matrix(8, 3)
    np.testing.assert_allclose(up.sum(1), 1)
    np.testing.assert_allclose(down.sum(1), 1)
    np.testing.assert_allclose(up[3], [-0.0703125, 0.8671875, 0.2265625, -0.0234375], rtol=1e-12)  # by hand
    assert (down != 0).sum(1).max() > 4  # shrinking stretches the filter over more inputs


@pytest.mark.slow
@pytest.mark.parametrize("arch, names, how", [(TIMM, "timm", "check"), ("hf_vit_tiny", "hf", "check"),
                                              ("hf_vit_tiny", "hf4", "hub")])
def test_exported_vit_weights_load_strictly_with_the_same_logits(made, torch_python, tmp_path, arch, names, how):
    """timm's and transformers 5's names through ``load_state_dict(strict=True)``; transformers 4's (the Hub's
    files) through ``from_pretrained``, which renames them (nothing missing or unexpected); jaxtrain reads each
    back to the same parameters."""
    out = made(arch, 7)
    net = vit(7)
    variables = pretrained.load(out / "weights.safetensors", into=net).variables
    path = pretrained.save("vit_tiny", variables, tmp_path / "back.safetensors", names=names)
    reference(torch_python, how, arch, 7, SIZE, out, path)
    assert relative(np.load(out / "checked.npy"), net.logits(*variables, np.load(out / "x.npy"))) < 1e-4
    again = pretrained.load(path, into=net)
    assert again.unused == () and again.replaced == ()
    jax.tree.map(np.testing.assert_array_equal, again.params, variables[0])
    with pytest.raises(ConfigError, match=r"vit_tiny is written in timm or hf or hf4's names, not 'torchvision'"):
        pretrained.save("vit_tiny", variables, tmp_path / "x.safetensors", names="torchvision")


@pytest.mark.slow
def test_another_vits_tensors_are_refused_not_left_unused(made, tmp_path):
    """A tensor jaxtrain's ViT would not compute with (layer scale, a deeper file) means another network: one
    line, never a model that silently computes something else."""
    whole = tensors.read(made(TIMM, 7) / "weights.safetensors")

    def load(changed: dict, into=None):
        tensors.write(changed, tmp_path / "w.safetensors")
        return pretrained.load(tmp_path / "w.safetensors", into=into or vit(7))

    with pytest.raises(ConfigError, match=r"the file's ViT has blocks.0.ls1.gamma, which vit_tiny does not compute"):
        load({**whole, "blocks.0.ls1.gamma": np.ones(192, np.float32)})
    deeper = {**whole, **{k.replace("blocks.11.", "blocks.12."): v for k, v in whole.items() if "blocks.11." in k}}
    with pytest.raises(ConfigError, match=r"the file's ViT has 13 blocks, vit_tiny 12: another size\?"):
        load(deeper)
    with pytest.raises(ConfigError, match=r"no tensor blocks.3.attn.qkv.weight \(for vit_tiny's stages/qkv\): is it "
                                          r"a timm or hf or hf4 vit file\?"):
        load({k: v for k, v in whole.items() if k != "blocks.3.attn.qkv.weight"})
    with pytest.raises(ConfigError, match=r"w.safetensors: blocks.0.mlp.fc1.weight is 768x96, vit_tiny needs 768x192"):
        load({**whole, "blocks.0.mlp.fc1.weight": whole["blocks.0.mlp.fc1.weight"][:, :96]})
    with pytest.raises(ConfigError, match=r"w.safetensors: patch_embed.proj.weight is 192x768: not the ViT tensor "
                                          r"vit_tiny's embed/patch is made from"):
        load({**whole, "patch_embed.proj.weight": np.zeros((192, 768), np.float32)})
    hf = tensors.read(made("hf_vit_tiny", 7) / "weights.safetensors")
    fewer = load(hf, into=vit(3))  # transformers' classifier for 7 classes, 3 here: the model's own
    assert fewer.replaced == ("classifier.bias (7 -> 3)", "classifier.weight (7x192 -> 3x192)")
    with pytest.raises(ConfigError, match=r"w.safetensors: vit.embeddings.patch_embeddings.projection.bias is 192, "
                                          r"vit_small needs 384 there: another network\?"):
        load(hf, into=vit(7, name="vit_small"))
    with pytest.raises(ConfigError, match=r"no tensor layer1.0.bn1.bias .*is it a torchvision or timm resnet50 file"):
        load(whole, into="resnet50")  # a ViT's file in a ResNet
    with pytest.raises(ConfigError, match=r"w.safetensors: no ViT patch embedding"):
        load({"conv1.weight": np.zeros((64, 3, 7, 7), np.float32)})  # a ResNet's file in a ViT
    with pytest.raises(ConfigError, match=r"timm's ViT-Tiny/16 is vit_tiny \(vit is jaxtrain's small one\)"):
        pretrained.load(tmp_path / "w.safetensors", into="vit")


def test_the_vit_configs_are_timms_sizes_and_the_small_vit_is_unchanged():
    """vit_tiny / _small / _base have timm's parameter counts (vit_tiny_patch16_224 with 1000 classes: 5,717,416);
    jaxtrain's own small ViT keeps its parameters."""
    def count(name, **kw):
        shapes = jax.eval_shape(lambda: models.get(name, **kw).init(jax.random.key(0))[0])
        return sum(int(np.prod(s.shape)) for s in jax.tree.leaves(shapes))

    assert count("vit_tiny", input_shape=(224, 224, 3), num_classes=1000) == 5_717_416
    assert count("vit_small", input_shape=(224, 224, 3), num_classes=1000) == 22_050_664
    assert count("vit_base", input_shape=(224, 224, 3), num_classes=1000) == 86_567_656
    assert count("vit") == 272_778  # as before the configs (git show 41e9202:jaxtrain/models/vit.py)


@pytest.mark.slow
def test_init_from_starts_a_vit_run_from_a_timm_file_resampled_to_its_images(made, tmp_path):
    """--model vit_tiny --init-from: 32x32 images (2x2 patches) from a 64x64 file (4x4), 3 classes from 7: the
    position embedding resampled and the classifier fresh, both said in the run's first lines; one step at lr
    1e-30 leaves the blocks as the file had them."""
    from conftest import run_cli
    from image_folders import make_folder

    from jaxtrain.driver import export

    out = made(TIMM, 7)
    root = make_folder(tmp_path / "d", {"train": 4, "val": 1})
    run = run_cli("-m", "jaxtrain.cli", "--model", "vit_tiny", "--dataset", f"folder:{root}", "--image-size", "32",
                  "--batch-size", "4", "--max-steps", "1", "--lr", "1e-30", "--devices", "2", "--no-progress",
                  "--init-from", str(out / "weights.safetensors"), "--out", str(tmp_path / "run"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert (f"{out / 'weights.safetensors'}: loaded; resampled pos_embed (4x4 -> 2x2 patches); replaced head.bias "
            "(7 -> 3), head.weight (7x192 -> 3x192)") in run.stdout
    _, params, _ = export.load(tmp_path / "run")
    qkv = tensors.read(out / "weights.safetensors")["blocks.5.attn.qkv.weight"]
    np.testing.assert_allclose(params["stages"]["qkv"][5], qkv.T, rtol=1e-6)
