"""A checkpoint file of another library as named numpy arrays, and back.

``.safetensors`` (Hugging Face's format; read and written with the ``safetensors`` package) and ``.pth`` /
``.pt`` / ``.bin`` (PyTorch's ``torch.save`` of a ``state_dict``, its zip format). A PyTorch file is read
without PyTorch: its pickle is unpickled with only tensors, storages and dicts allowed (a file cannot run
code, as with ``torch.load(weights_only=True)``), each tensor's bytes taken from the zip. A checkpoint dict
holding the state dict under ``state_dict``, ``model`` or ``model_state_dict`` is read too. Writing ``.pth``
needs torch. Nothing is downloaded: the user supplies the file.
"""

from __future__ import annotations

import collections
import pickle
import zipfile
from pathlib import Path

import numpy as np

from jaxtrain.errors import ConfigError

TORCH_SUFFIXES = (".pth", ".pt", ".bin")
SUFFIXES = (".safetensors", *TORCH_SUFFIXES)
_NESTED = ("state_dict", "model", "model_state_dict")


def _need(package: str, why: str):
    import importlib

    try:
        return importlib.import_module(package)
    except ImportError:
        raise ConfigError(f"{why} needs the {package.split('.')[0]} package: pip install "
                          f"{'torch' if package == 'torch' else 'safetensors'}") from None


def _dtypes() -> dict:
    import ml_dtypes

    return {"DoubleStorage": np.float64, "FloatStorage": np.float32, "HalfStorage": np.float16,
            "BFloat16Storage": ml_dtypes.bfloat16, "LongStorage": np.int64, "IntStorage": np.int32,
            "ShortStorage": np.int16, "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_}


def _rebuild_tensor(storage, offset, size, stride, *args):
    item = storage.itemsize
    return np.lib.stride_tricks.as_strided(storage[offset:], tuple(size), tuple(s * item for s in stride)).copy()


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
        _, dtype, key, _location, numel = pid
        return np.frombuffer(self.archive.read(f"{self.prefix}/data/{key}"), dtype, count=numel)


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
    except (pickle.UnpicklingError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        raise ConfigError(f"{path}: not a PyTorch state_dict ({type(e).__name__}: {str(e)[:100]})") from None


def read(path: str | Path) -> dict[str, np.ndarray]:
    """The file's tensors by name (float32 where they were a float type; integer counters as they were)."""
    path = Path(path).expanduser()
    if path.suffix not in SUFFIXES:
        raise ConfigError(f"{path}: not a checkpoint jaxtrain reads (give a {', '.join(SUFFIXES)} file)")
    if not path.is_file():
        raise ConfigError(f"{path}: no such file")
    if path.suffix == ".safetensors":
        numpy_io = _need("safetensors.numpy", f"reading {path.name}")
        try:
            tensors = numpy_io.load_file(str(path))
        except Exception as e:  # noqa: BLE001 - a damaged or foreign file: one line
            raise ConfigError(f"{path}: not a safetensors file ({type(e).__name__}: {str(e)[:100]})") from None
    else:
        loaded = _torch_file(path)
        for key in _NESTED:
            if isinstance(loaded, dict) and isinstance(loaded.get(key), dict):
                loaded = loaded[key]
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: holds a {type(loaded).__name__}, not a state_dict (save model.state_dict())")
        tensors = {k: v for k, v in loaded.items() if isinstance(v, np.ndarray)}
    return {k: np.asarray(v, np.float32) if np.issubdtype(np.asarray(v).dtype, np.floating) else np.asarray(v)
            for k, v in tensors.items()}


def write(tensors: dict[str, np.ndarray], path: str | Path) -> Path:
    """``tensors`` saved as ``path`` says (``.safetensors``, or PyTorch's ``.pth``), whole or not at all."""
    import os

    path = Path(path).expanduser()
    if path.suffix not in SUFFIXES:
        raise ConfigError(f"{path}: give a {', '.join(SUFFIXES)} file name")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    arrays = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    if path.suffix == ".safetensors":
        _need("safetensors.numpy", f"writing {path.name}").save_file(arrays, str(tmp))
    else:
        torch = _need("torch", f"writing {path.name} (PyTorch's format)")
        torch.save({k: torch.from_numpy(v) for k, v in arrays.items()}, str(tmp))
    os.replace(tmp, path)
    return path
