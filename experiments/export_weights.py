"""A finished run's model as a file torchvision, timm or transformers load (jaxtrain.driver.export.save_pretrained).

    python -m experiments.export_weights RUN_DIR FILE      # FILE: .safetensors (or .pth, with torch installed)
    python -m experiments.export_weights RUN_DIR FILE --names hf   # a ViT in Hugging Face's names

Then, in PyTorch: ``torchvision.models.resnet18(num_classes=K).load_state_dict(safetensors.torch.load_file(FILE))``
(docs/pretrained.md); its inputs normalised with ImageNet's mean and std, as jaxtrain's ImageNet ResNets do inside
(a ViT's with 0.5 and 0.5: ``timm.create_model("vit_tiny_patch16_224", num_classes=K, img_size=S)``, or
``transformers.ViTForImageClassification``).
"""

import argparse
import sys

from jaxtrain.cli import one_line_errors


@one_line_errors("export_weights")
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.export_weights", description=__doc__.split("\n")[0])
    p.add_argument("run_dir", help="a finished run's --out directory (holding model/ and model.json)")
    p.add_argument("file", help="where to write: NAME.safetensors, or NAME.pth (needs torch)")
    p.add_argument("--names", choices=("torchvision", "timm", "hf", "hf4"),
                   help="whose tensor names (default: torchvision's for a ResNet, timm's for a ViT; hf: a ViT as "
                        "transformers 5's ViTForImageClassification, hf4: as transformers 4's, the Hub's files)")
    args = p.parse_args(argv)
    from jaxtrain.driver.export import save_pretrained

    print(f"wrote {save_pretrained(args.run_dir, args.file, names=args.names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
