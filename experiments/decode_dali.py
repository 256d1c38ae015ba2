"""NVIDIA DALI's side of experiments.decode_bench, on the CPU alone (any Python with ``nvidia-dali-cuda120``).

    python experiments/decode_dali.py ROOT SIZE BATCH THREADS BATCHES

DALI's ImageNet training pipeline with every operator on the CPU (``device_id=None``: no GPU needed):
``fn.readers.file`` (class folders, shuffled), ``fn.decoders.image_random_crop`` (libjpeg-turbo, decoding only
the random-resized-crop's region: 8-100% of the area, aspect 3/4-4/3, as torchvision's), ``fn.resize`` to
SIZE x SIZE (linear, antialiased), ``fn.flip`` by a coin flip; uint8 HWC out. THREADS: DALI's CPU threads.
Prints one JSON line, ``{"images_per_s": ...}``, over BATCHES batches after 2 warm-up batches.
"""

import json
import sys
import time


def main(root: str, size: int, batch: int, threads: int, batches: int) -> dict:
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=batch, num_threads=threads, device_id=None, seed=0, prefetch_queue_depth=2)
    def pipeline():
        jpegs, labels = fn.readers.file(file_root=root, random_shuffle=True, name="reader")
        images = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB,
                                               random_area=[0.08, 1.0], random_aspect_ratio=[3 / 4, 4 / 3],
                                               num_attempts=10)
        images = fn.resize(images, resize_x=size, resize_y=size, interp_type=types.INTERP_LINEAR, antialias=True)
        images = fn.flip(images, horizontal=fn.random.coin_flip())
        return images, labels

    pipe = pipeline()
    pipe.build()
    for _ in range(2):
        pipe.run()
    start = time.perf_counter()
    for _ in range(batches):
        images, _ = pipe.run()
        assert images.as_array().shape == (batch, size, size, 3)
    return {"images_per_s": batches * batch / (time.perf_counter() - start)}


if __name__ == "__main__":
    root, size, batch, threads, batches = sys.argv[1], *map(int, sys.argv[2:6])
    print(json.dumps(main(root, size, batch, threads, batches)), flush=True)
