"""A checkpoint file of another library as named numpy arrays, and back.

``.safetensors`` (Hugging Face's format; read here, bfloat16 too; written with the ``safetensors`` package)
and ``.pth`` / ``.pt`` / ``.bin`` (PyTorch's ``torch.save`` of a ``state_dict``, its zip format). A PyTorch file is read
without PyTorch: its pickle is unpickled with only tensors, storages and dicts allowed (a file cannot run
code, as with ``torch.load(weights_only=True)``), each tensor's bytes taken from the zip. A checkpoint dict
holding the state dict under ``state_dict``, ``model`` or ``model_state_dict`` is read too. Writing ``.pth``
needs torch. Nothing is downloaded: the user supplies the file.
"""

from __future__ import annotations

import collections
import json
import math
import pickle
import struct
import zipfile
from pathlib import Path
from typing import NamedTuple

import numpy as np

from jaxtrain.errors import ConfigError, need

TORCH_SUFFIXES = (".pth", ".pt", ".bin")
SUFFIXES = (".safetensors", *TORCH_SUFFIXES)
_NESTED = ("state_dict", "model", "model_state_dict")


class Mismatch(Exception):
    """A source tensor of another shape than the model's: ``Mismatch(name, the shape needed there)``."""


def _need(package: str, why: str):
    import importlib

    if package.startswith("safetensors"):
        return need(package, why)
    try:
        return importlib.import_module(package)
    except ImportError:
        raise ConfigError(f"{why} needs the {package} package: pip install {package}") from None


def _dtypes() -> dict:
    import ml_dtypes

    return {"DoubleStorage": np.float64, "FloatStorage": np.float32, "HalfStorage": np.float16,
            "BFloat16Storage": ml_dtypes.bfloat16, "LongStorage": np.int64, "IntStorage": np.int32,
            "ShortStorage": np.int16, "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_}


def _whole(*values) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values)


class _Repeats(NamedTuple):
    """A tensor with more elements than its storage holds from its offset (a zero or overlapping stride: torch
    saves ``expand()``'s views as they are), never copied: its copy could be any size (tens of GB from a file of a
    few bytes). ``read`` names it in its error (the unpickler does not know the name)."""

    elements: int
    stored: int


def _rebuild_tensor(storage, offset, size, stride, *args):
    """The tensor ``storage[offset:]`` viewed with ``size`` and ``stride``, copied; refused unless every element
    it would read lies inside the storage (a crafted file must not read memory around it), and never more
    elements than the storage holds (``_Repeats``)."""
    size, stride = tuple(size), tuple(stride)
    if not (isinstance(storage, np.ndarray) and storage.ndim == 1 and _whole(offset, *size, *stride)
            and len(size) == len(stride)):
        raise pickle.UnpicklingError("a tensor whose storage, offset, size or stride is not a tensor's")
    last = offset + sum((n - 1) * s for n, s in zip(size, stride))
    if math.prod(size) and last >= storage.size:
        raise pickle.UnpicklingError(f"a tensor reaching element {last} of a storage of {storage.size}")
    if math.prod(size) > storage.size - offset:
        return _Repeats(math.prod(size), storage.size - offset)
    item = storage.itemsize
    return np.lib.stride_tricks.as_strided(storage[offset:], size, tuple(s * item for s in stride)).copy()


class _Unpickler(pickle.Unpickler):
    """PyTorch's data.pkl with only what a state_dict holds: tensors (numpy arrays), storages, dicts."""

    def __init__(self, file, archive: zipfile.ZipFile, prefix: str):
        super().__init__(file)
        self.archive, self.prefix, self.dtypes = archive, prefix, _dtypes()

    def find_class(self, module, name):
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if (module, name) == ("torch._utils", "_rebuild_parameter"):
            return lambda data, *args: data
        if module == "torch" and name in self.dtypes:
            return self.dtypes[name]
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a state_dict")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError("a persistent id that is not a storage's")
        _, dtype, key, _location, numel = pid
        if not any(dtype is d for d in self.dtypes.values()) or not _whole(numel) or not isinstance(key, str):
            raise pickle.UnpicklingError(f"a storage of {dtype!r} ({numel!r} elements) is not a tensor's")
        data = self.archive.read(f"{self.prefix}/data/{key}")
        if numel * np.dtype(dtype).itemsize > len(data):
            raise pickle.UnpicklingError(f"storage {key} holds {len(data)} bytes, not {numel} elements")
        return np.frombuffer(data, dtype, count=numel)


def _torch_file(path: Path):
    """What ``torch.save`` wrote to ``path`` (its zip format: torch 1.6 and later), tensors as numpy arrays."""
    if not zipfile.is_zipfile(path):
        raise ConfigError(f"{path}: not PyTorch's zip format (torch.save since 1.6): re-save it with a recent torch, "
                          "or as .safetensors")
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [n for n in archive.namelist() if n.endswith("/data.pkl")]
            if not pickles:
                raise ValueError("no data.pkl")
            prefix = pickles[0][: -len("/data.pkl")]
            names = set(archive.namelist())
            order = archive.read(f"{prefix}/byteorder").strip() if f"{prefix}/byteorder" in names else b"little"
            if order != b"little":
                raise ValueError(f"tensors in {order.decode()}-endian order")
            with archive.open(pickles[0]) as f:
                return _Unpickler(f, archive, prefix).load()
    except (pickle.UnpicklingError, ValueError, KeyError, EOFError, zipfile.BadZipFile, TypeError, AttributeError,
            IndexError, MemoryError, OverflowError, RecursionError) as e:
        raise ConfigError(f"{path}: not a PyTorch state_dict ({type(e).__name__}: {str(e)[:100]})") from None


def read(path: str | Path, *, stored: bool = False) -> dict[str, np.ndarray]:
    """The file's tensors by name (float32 where they were a float type; integer counters as they were;
    ``stored``: each in the dtype the file holds it in)."""
    path = Path(path).expanduser()
    if path.suffix not in SUFFIXES:
        raise ConfigError(f"{path}: not a checkpoint jaxtrain reads (give a {', '.join(SUFFIXES)} file)")
    if not path.is_file():
        raise ConfigError(f"{path}: no such file")
    if path.suffix == ".safetensors":
        tensors = _safetensors_file(path)
    else:
        loaded = _torch_file(path)
        for key in _NESTED:
            if isinstance(loaded, dict) and isinstance(loaded.get(key), dict):
                loaded = loaded[key]
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: holds a {type(loaded).__name__}, not a state_dict (save model.state_dict())")
        for name, value in loaded.items():
            if isinstance(value, _Repeats):
                raise ConfigError(f"{path}: tensor {name!r} has {value.elements} elements, more than the "
                                  f"{value.stored} its storage holds (a zero or overlapping stride, as torch's "
                                  "expand() makes): save it with .contiguous(), or .clone(), before torch.save")
        tensors = {k: v for k, v in loaded.items() if isinstance(v, np.ndarray)}
    return tensors if stored else as_float32(tensors)


def as_float32(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """float32 where a tensor is of a float type (float16, bfloat16, float64), the others as they are."""
    return {k: np.asarray(v, np.float32) if is_float(v.dtype) else np.asarray(v) for k, v in tensors.items()}


def is_float(dtype) -> bool:
    return np.issubdtype(dtype, np.floating) or np.dtype(dtype).name == "bfloat16"


def _safetensors_file(path: Path) -> dict[str, np.ndarray]:
    """A safetensors file's tensors (its format: an 8-byte header length, a JSON header of each tensor's dtype,
    shape and byte range, the bytes), read here so that bfloat16 comes in too; every range checked."""
    import ml_dtypes

    dtypes = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "I64": np.int64,
              "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > 100 << 20:
                raise ValueError(f"a header of {length} bytes")
            header = json.loads(f.read(length))
            data = f.read()
        tensors = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype, shape, (start, end) = np.dtype(dtypes[info["dtype"]]), tuple(info["shape"]), info["data_offsets"]
            if not (_whole(start, end, *shape) and start <= end <= len(data)
                    and end - start == math.prod(shape) * dtype.itemsize):
                raise ValueError(f"{name}'s bytes {start}:{end} do not hold {dtype.name} {shape}")
            tensors[name] = np.frombuffer(data, dtype, count=math.prod(shape), offset=start).reshape(shape)
        return tensors
    except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error) as e:
        raise ConfigError(f"{path}: not a safetensors file ({type(e).__name__}: {str(e)[:100]})") from None


def write(tensors: dict[str, np.ndarray], path: str | Path) -> Path:
    """``tensors`` saved as ``path`` says (``.safetensors``, or PyTorch's ``.pth``), whole or not at all."""
    import os

    path = Path(path).expanduser()
    if path.suffix not in SUFFIXES:
        raise ConfigError(f"{path}: give a {', '.join(SUFFIXES)} file name")
    if not path.parent.is_dir():
        raise ConfigError(f"{path}: its folder {path.parent} does not exist")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    arrays = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    try:
        if path.suffix == ".safetensors":
            _need("safetensors.numpy", f"writing {path.name}").save_file(arrays, str(tmp))
        else:
            torch = _need("torch", f"writing {path.name} (PyTorch's format; or write .safetensors, which torch "
                                   "reads with safetensors.torch.load_file)")
            torch.save({k: torch.from_numpy(v) for k, v in arrays.items()}, str(tmp))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
