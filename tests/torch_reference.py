"""The PyTorch side of tests/test_pretrained.py and tests/test_pretrained_vit.py, run in a Python with torch,
torchvision, timm, transformers and safetensors (``$JAXTRAIN_TORCH_PYTHON``; ``make torch-venv`` builds one).
Never imported by pytest.

    python tests/torch_reference.py make ARCH CLASSES SIZE DIR    # a random model's files, input and outputs
    python tests/torch_reference.py check ARCH CLASSES SIZE DIR FILE   # FILE loaded strictly: its logits
    python tests/torch_reference.py resample ARCH CLASSES SIZE DIR NEW  # DIR's weights in a timm ViT for NEW
    python tests/torch_reference.py hub ARCH CLASSES SIZE DIR FILE     # FILE through from_pretrained: its logits

ARCH: a torchvision model (``resnet18``), a timm one (``timm_resnet50``, ``timm_vit_tiny_patch16_224``), or a
Hugging Face ViT-Tiny/16 (``hf_vit_tiny``: ``ViTForImageClassification``; ``hf_vit_tiny_model``: ``ViTModel``,
whose "logits" are its last hidden state's class token, after its layer norm). ``make``: a randomly initialised
model (seed 0; every BatchNorm's statistics and affine parameters, every layer norm's and every bias drawn at
random too, so nothing is the identity) saved as DIR/weights.pth and DIR/weights.safetensors; a random batch
DIR/x.npy (NHWC); its evaluation-mode logits DIR/logits.npy; then, for the ResNets, one SGD step in training mode
(lr 0.1, cross-entropy on DIR/y.npy): DIR/after.safetensors (its state_dict after). ``check``: FILE (.pth or
.safetensors) loaded with ``load_state_dict(strict=True)``; its logits on DIR/x.npy written to DIR/checked.npy.
``hub``: FILE as a Hugging Face model folder's model.safetensors (beside its config.json), loaded with
``from_pretrained`` (which renames transformers 4's names): no tensor missing or unexpected; logits as ``check``'s.
``resample``: DIR's weights in the timm ViT made for NEW x NEW images (or HxW: NEW "32x128"), through timm's own
checkpoint filter (its position embedding resampled); its logits on DIR/x_NEW.npy (a random batch written first)
to DIR/resampled_NEW.npy. Images are in [0, 1] (as jaxtrain's loaders give them) and normalised before the model as
the model's source normalises them (ImageNet's mean and std for the ResNets, 0.5 and 0.5 for the ViTs: jaxtrain's
models do it inside).
"""

import sys
from pathlib import Path

import numpy as np


MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # ImageNet's: what torchvision's transforms feed


def normalized(x, arch: str):
    """NHWC images in [0, 1] -> NCHW, normalised as the source's transforms normalise them."""
    import torch

    mean, std = ((0.5,) * 3, (0.5,) * 3) if "vit" in arch else (MEAN, STD)
    x = torch.from_numpy(x).permute(0, 3, 1, 2)
    return (x - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)


def build(arch: str, classes: int, size: int):
    if arch.startswith("hf_vit_tiny"):
        from transformers import ViTConfig, ViTForImageClassification, ViTModel

        config = ViTConfig(hidden_size=192, num_hidden_layers=12, num_attention_heads=3, intermediate_size=768,
                           image_size=size, patch_size=16, num_labels=classes)
        return (ViTModel(config, add_pooling_layer=True) if arch.endswith("_model")
                else ViTForImageClassification(config))
    import timm
    import torchvision

    if arch.startswith("timm_vit"):
        return timm.create_model(arch[len("timm_"):], pretrained=False, num_classes=classes, img_size=size)
    if arch.startswith("timm_"):
        return timm.create_model(arch[len("timm_"):], pretrained=False, num_classes=classes)
    return getattr(torchvision.models, arch)(num_classes=classes)


def forward(model, x, arch: str):
    out = model(normalized(x, arch))
    if arch.startswith("hf_vit_tiny"):
        return out.last_hidden_state[:, 0] if arch.endswith("_model") else out.logits
    return out


def randomised(model) -> None:
    """Every norm's scale and shift, every bias, BatchNorm statistics, class token and position embedding drawn."""
    import torch

    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.2)
                m.running_var.uniform_(0.5, 2.0)
            if isinstance(m, (torch.nn.BatchNorm2d, torch.nn.LayerNorm)):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.2)
            elif isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)) and m.bias is not None:
                m.bias.normal_(0, 0.05)
        for name, p in model.named_parameters():
            if name.endswith(("cls_token", "pos_embed", "position_embeddings")):
                p.normal_(0, 0.5)


def main(argv):
    import torch
    from safetensors.torch import load_file, save_file

    command, arch, classes, size, out = argv[0], argv[1], int(argv[2]), int(argv[3]), Path(argv[4])
    torch.manual_seed(0)
    model = build(arch, classes, size)
    if command == "hub":
        import shutil

        folder = out / "hub"
        folder.mkdir(exist_ok=True)
        model.config.save_pretrained(folder)
        shutil.copy(argv[5], folder / "model.safetensors")
        model, info = type(model).from_pretrained(folder, output_loading_info=True)
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
        model.eval()
        with torch.no_grad():
            np.save(out / "checked.npy", forward(model, np.load(out / "x.npy"), arch).numpy())
        return 0
    if command in ("check", "resample"):
        if command == "resample":
            import timm

            new = tuple(int(side) for side in argv[5].split("x")) * (1 if "x" in argv[5] else 2)  # "96", "32x128"
            model = build(arch, classes, new)
            state = timm.models.vision_transformer.checkpoint_filter_fn(load_file(out / "weights.safetensors"), model)
            x, target = np.random.default_rng(1).random((2, *new, 3), dtype=np.float32), f"resampled_{argv[5]}.npy"
            np.save(out / f"x_{argv[5]}.npy", x)
        else:
            file = argv[5]
            state = load_file(file) if file.endswith(".safetensors") else torch.load(file, weights_only=True)
            x, target = np.load(out / "x.npy"), "checked.npy"
        model.load_state_dict(state, strict=True)
        model.eval()
        with torch.no_grad():
            np.save(out / target, forward(model, x, arch).numpy())
        return 0
    randomised(model)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    torch.save(state, out / "weights.pth")
    save_file(state, str(out / "weights.safetensors"))
    rng = np.random.default_rng(0)
    x = rng.random((4, size, size, 3), dtype=np.float32)
    y = rng.integers(0, classes, 4)
    np.save(out / "x.npy", x)
    np.save(out / "y.npy", y)
    model.eval()
    with torch.no_grad():
        np.save(out / "logits.npy", forward(model, x, arch).numpy())
    if "vit" in arch:
        return 0
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = torch.nn.functional.cross_entropy(forward(model, x, arch), torch.from_numpy(y))
    loss.backward()
    opt.step()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "after.safetensors"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
