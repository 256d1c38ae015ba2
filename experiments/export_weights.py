"""A finished run's model as a file torchvision, timm or transformers load: ``jaxtrain export`` (jaxtrain.cli.export)
in the checkout.

    python -m experiments.export_weights RUN_DIR FILE      # FILE: .safetensors (or .pth, with torch installed)
    python -m experiments.export_weights RUN_DIR FILE --names hf   # a ViT in Hugging Face's names

Then, in PyTorch: ``torchvision.models.resnet18(num_classes=K).load_state_dict(safetensors.torch.load_file(FILE))``
(docs/pretrained.md); its inputs normalised with ImageNet's mean and std, as jaxtrain's ImageNet ResNets do inside
(a ViT's with 0.5 and 0.5: ``timm.create_model("vit_tiny_patch16_224", num_classes=K, img_size=S)``, or
``transformers.ViTForImageClassification``).
"""

import sys

from jaxtrain.cli import export  # light: JAX is imported after the flags are read


def main(argv=None) -> int:
    return export(argv, prog="python -m experiments.export_weights")


if __name__ == "__main__":
    sys.exit(main())
