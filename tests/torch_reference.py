"""The PyTorch side of tests/test_pretrained.py, run in a Python with torch, torchvision, timm and safetensors
(``$JAXTRAIN_TORCH_PYTHON``; ``make torch-venv`` builds one). Never imported by pytest.

    python tests/torch_reference.py make ARCH CLASSES SIZE DIR    # a random model's files, input and outputs
    python tests/torch_reference.py check ARCH CLASSES SIZE DIR FILE   # FILE loaded strictly: its logits

``make``: a randomly initialised torchvision or timm model (seed 0; BatchNorm statistics and affine
parameters drawn at random too, so evaluation is not the identity) saved as DIR/weights.pth and
DIR/weights.safetensors; a random batch DIR/x.npy (NHWC); its evaluation-mode logits DIR/logits.npy; then one
SGD step in training mode (lr 0.1, cross-entropy on DIR/y.npy): DIR/after.safetensors (its state_dict after).
``check``: FILE (.pth or .safetensors) loaded with ``load_state_dict(strict=True)``; its logits on DIR/x.npy
written to DIR/checked.npy. Images are in [0, 1] (as jaxtrain's loaders give them) and normalised with
ImageNet's mean and std before the model, as torchvision's transforms do (jaxtrain's ImageNet ResNets do it
inside).
"""

import sys
from pathlib import Path

import numpy as np


MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # ImageNet's: what torchvision's transforms feed


def normalized(x):
    """NHWC images in [0, 1] -> NCHW, normalised as torchvision's transforms normalise them."""
    import torch

    x = torch.from_numpy(x).permute(0, 3, 1, 2)
    return (x - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)


def build(arch: str, classes: int):
    import timm
    import torchvision

    if arch.startswith("timm_"):
        return timm.create_model(arch[len("timm_"):], pretrained=False, num_classes=classes)
    return getattr(torchvision.models, arch)(num_classes=classes)


def main(argv):
    import torch
    from safetensors.torch import load_file, save_file

    command, arch, classes, size, out = argv[0], argv[1], int(argv[2]), int(argv[3]), Path(argv[4])
    torch.manual_seed(0)
    model = build(arch, classes)
    if command == "check":
        file = argv[5]
        state = load_file(file) if file.endswith(".safetensors") else torch.load(file, weights_only=True)
        model.load_state_dict(state, strict=True)
        model.eval()
        with torch.no_grad():
            np.save(out / "checked.npy", model(normalized(np.load(out / "x.npy"))).numpy())
        return 0
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.2)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.2)
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
        np.save(out / "logits.npy", model(normalized(x)).numpy())
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = torch.nn.functional.cross_entropy(model(normalized(x)), torch.from_numpy(y))
    loss.backward()
    opt.step()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "after.safetensors"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
