"""torchvision's side of experiments.decode_bench, in its own process (any Python with torch + torchvision).

    python experiments/decode_torch.py ROOT SIZE BATCH WORKERS BATCHES

What a PyTorch user writes for ImageNet-style training: ``ImageFolder`` (Pillow's decode, ``convert("RGB")``),
``RandomResizedCrop(SIZE)`` + ``RandomHorizontalFlip()`` + ``PILToTensor()`` (uint8, as jaxtrain's batches),
a ``DataLoader`` with WORKERS worker processes (0: in this process), shuffled. Prints one JSON line:
``{"per_image_s": ..., "loader_images_per_s": ...}``: the transform's mean time per image in this process
(one core), then the DataLoader's images per second over BATCHES batches after 2 warm-up batches.
"""

import json
import sys
import time


def main(root: str, size: int, batch: int, workers: int, batches: int) -> dict:
    import torch
    from torchvision import datasets, transforms

    torch.set_num_threads(1)
    tf = transforms.Compose([transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip(),
                             transforms.PILToTensor()])
    data = datasets.ImageFolder(root, transform=tf)
    n = min(len(data), 200)
    start = time.perf_counter()
    for i in range(n):
        data[i * 7 % len(data)]
    per_image = (time.perf_counter() - start) / n
    loader = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True, num_workers=workers, drop_last=True,
                                         persistent_workers=workers > 0, generator=torch.Generator().manual_seed(0))
    it = iter(loader)
    for _ in range(2):
        next(it)
    start = time.perf_counter()
    for _ in range(batches):
        images, _ = next(it)
        assert images.dtype == torch.uint8 and tuple(images.shape[1:]) == (3, size, size)
    return {"per_image_s": per_image, "loader_images_per_s": batches * batch / (time.perf_counter() - start)}


if __name__ == "__main__":
    root, size, batch, workers, batches = sys.argv[1], *map(int, sys.argv[2:6])
    print(json.dumps(main(root, size, batch, workers, batches)), flush=True)
