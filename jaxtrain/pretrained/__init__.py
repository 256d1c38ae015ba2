"""Weights from other libraries, and back: ``load(path, into=MODEL)`` and ``save(MODEL, variables, path)``.

    from jaxtrain import pretrained
    params, model_state = pretrained.load("resnet50.pth", into="resnet50", num_classes=10).variables
    pretrained.save("resnet50", (params, model_state), "mine.safetensors")  # torchvision / timm load it back
    pretrained.save("vit_tiny", (params, {}), "vit.safetensors", names="hf")  # transformers' ViT loads it

A local file the user supplies (``jaxtrain.pretrained.tensors``: safetensors, or PyTorch's ``state_dict``),
mapped onto a registry model: ``resnet18_imagenet`` and ``resnet50`` (torchvision's and timm's ResNets,
``jaxtrain.pretrained.resnet``), ``vit_tiny`` / ``vit_small`` / ``vit_base`` (timm's ViTs with 16x16 patches and
Hugging Face's ``ViTModel`` / ``ViTForImageClassification``, ``jaxtrain.pretrained.vit``). Every tensor of the
file is used or named as unused (one line); a tensor the model needs that the file lacks, or whose shape
differs, is a one-line error naming it, except the classifier: with another class count (or none in the file)
it is the model's own fresh one (said as replaced). A ViT's position embedding for another image size is
resampled as timm resamples it (said too). Hugging Face's GPT-2 files load into ``jaxtrain.models.gpt``'s params
through ``jaxtrain.pretrained.gpt2`` (not a registry model yet).
"""

from jaxtrain.pretrained.weights import ARCHITECTURES, Loaded, export, load, save

__all__ = ["ARCHITECTURES", "Loaded", "export", "load", "save"]
