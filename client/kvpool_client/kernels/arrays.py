"""What the data-path calls need to know about a caller's array, whatever made it, without importing its framework.

``describe(x)`` reads NumPy arrays, CuPy arrays, PyTorch tensors (CPU or CUDA), and any object with
``__cuda_array_interface__`` (Numba, JAX via DLPack through CuPy) into one ``ArrayInfo``: address, shape, strides
in bytes, dtype name, device ordinal (None: host memory). PyTorch is never imported here: a tensor is recognised
by its type's module, so the client installs without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpool_client.errors import InvalidArgumentError


@dataclass(frozen=True)
class ArrayInfo:
    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # bytes
    dtype: str  # "float16", "bfloat16", "float32", "uint16", "int16", "int32", "int64", ...
    itemsize: int
    device: int | None  # CUDA ordinal, or None for host memory
    framework: str  # "numpy", "cupy", "torch", "cai"
    obj: Any

    def inner_contiguous(self, ndim: int) -> bool:
        """True if the last ``ndim`` dimensions are C-contiguous (the leading one may have any stride)."""
        expected = self.itemsize
        for size, stride in zip(reversed(self.shape[-ndim:]), reversed(self.strides[-ndim:])):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True


def is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def describe(x: Any) -> ArrayInfo:
    if isinstance(x, np.ndarray):
        return ArrayInfo(x.ctypes.data, x.shape, x.strides, x.dtype.name, x.itemsize, None, "numpy", x)
    if is_torch(x):
        dtype = str(x.dtype).removeprefix("torch.")
        size = x.element_size()
        device = x.device.index if x.is_cuda else None
        if x.is_cuda and device is None:
            import torch  # noqa: PLC0415

            device = torch.cuda.current_device()
        return ArrayInfo(x.data_ptr(), tuple(x.shape), tuple(s * size for s in x.stride()), dtype, size, device,
                         "torch", x)
    if type(x).__module__.startswith("cupy"):
        return ArrayInfo(x.data.ptr, x.shape, x.strides, x.dtype.name, x.itemsize, x.device.id, "cupy", x)
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is None and hasattr(x, "__dlpack__"):
        import cupy  # noqa: PLC0415

        return describe(cupy.from_dlpack(x))
    if cai is None:
        raise InvalidArgumentError(f"expected a NumPy or CuPy array or a PyTorch tensor, got {type(x).__name__}")
    dtype = np.dtype(cai["typestr"])
    shape = tuple(cai["shape"])
    strides = cai.get("strides") or tuple(int(np.prod(shape[i + 1 :], dtype=np.int64)) * dtype.itemsize
                                          for i in range(len(shape)))
    ptr = int(cai["data"][0])
    import cupy  # noqa: PLC0415

    device = cupy.cuda.runtime.pointerGetAttributes(ptr).device
    return ArrayInfo(ptr, shape, tuple(strides), dtype.name, dtype.itemsize, device, "cai", x)


def to_numpy(x: Any) -> np.ndarray:
    """A host array as NumPy (a PyTorch CPU tensor without a copy; bfloat16 as its uint16 bit patterns)."""
    if isinstance(x, np.ndarray):
        return x
    if is_torch(x):
        if x.is_cuda:
            raise InvalidArgumentError("expected a host tensor, got one on a CUDA device")
        if str(x.dtype) == "torch.bfloat16":
            import torch  # noqa: PLC0415

            return x.view(torch.int16).numpy().view(np.uint16)
        return x.numpy()
    return np.asarray(x)


# dtypes a caller may pass for each storage dtype of the layout: bytes are moved as they are, never converted
ACCEPTED_DTYPES = {
    "float32": ("float32",),
    "float16": ("float16",),
    "bfloat16": ("bfloat16", "uint16", "int16"),
}
