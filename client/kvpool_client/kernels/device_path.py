"""The GPU side of ``AttachedPool``'s data calls: validate the caller's arrays, pick the stream, launch the kernel.

    caller's device array (CuPy / PyTorch / CAI)  --one kernel on the caller's stream-->  pool slots
    caller's host array (NumPy)  --pinned staging, H2D on the stream-->  device staging  --kernel-->  pool
                                 (synchronous: the call returns once the staging can be reused)

Device inputs are **asynchronous**: the work is enqueued on ``stream`` (default: PyTorch's current stream when any
argument is a tensor, else CuPy's current stream) and the call returns at once. Synchronize that stream (or an
event recorded on it) before another process -- the server, another client -- reads the slots.

Slots given as a host array are checked against the pool on the host and raise ``InvalidArgumentError``; slots
given as a device array are not copied back to be checked: the kernel skips any slot outside the pool and raises a
flag that ``check_slot_errors()`` (which synchronizes) turns into ``InvalidArgumentError``.
"""

from __future__ import annotations

import warnings
from typing import Any

import cupy
import numpy as np

from kvpool.layout import KVLayout
from kvpool_client.errors import InvalidArgumentError
from kvpool_client.kernels import slot_kernels
from kvpool_client.kernels.arrays import ACCEPTED_DTYPES, ArrayInfo, describe, is_torch, to_numpy

_H2D, _D2H = 1, 2


_external: dict[tuple[int, int], Any] = {}


def _wrap(ptr: int) -> Any:
    """A CuPy handle on a stream made elsewhere (cached: a handle only names the stream)."""
    key = (ptr, cupy.cuda.Device().id)
    s = _external.get(key)
    if s is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            s = _external[key] = cupy.cuda.ExternalStream(ptr)
    return s


def resolve_stream(stream: Any, args: tuple[Any, ...]) -> Any:
    """A CuPy stream for ``stream``: None (the callers' framework's current stream), a CuPy or PyTorch stream,
    or a raw ``cudaStream_t`` as an int."""
    if stream is None:
        if any(is_torch(a) for a in args):
            import torch  # noqa: PLC0415

            return _wrap(torch.cuda.current_stream().cuda_stream)
        return cupy.cuda.get_current_stream()
    if type(stream).__module__.startswith("cupy"):
        return stream
    if hasattr(stream, "cuda_stream"):  # torch.cuda.Stream
        return _wrap(stream.cuda_stream)
    if isinstance(stream, int):
        return _wrap(stream)
    raise InvalidArgumentError(f"stream must be a CuPy or PyTorch stream or an int, got {type(stream).__name__}")


class _Pinned:
    """A growable pinned host buffer and its device twin; ``ready`` guards the pinned half's reuse."""

    def __init__(self) -> None:
        self.host: Any = None
        self.device: Any = None
        self.nbytes = 0
        self.ready: cupy.cuda.Event | None = None

    def reserve(self, nbytes: int) -> None:
        if self.ready is not None:
            self.ready.synchronize()  # the last copy out of (or into) the pinned buffer has finished
        if nbytes > self.nbytes:
            size = max(nbytes, 2 * self.nbytes, 1 << 16)
            self.host = cupy.cuda.alloc_pinned_memory(size)
            self.device = cupy.cuda.alloc(size)
            self.nbytes = size

    def host_array(self, nbytes: int) -> np.ndarray:
        return np.frombuffer(self.host, dtype=np.uint8, count=nbytes)


class DevicePath:
    def __init__(self, pool_ptr: int, layout: KVLayout, num_blocks: int, device: int) -> None:
        self.pool_ptr = pool_ptr
        self.layout = layout
        self.device = device
        self.num_slots = num_blocks * layout.block_size
        self.row_bytes = layout.num_kv_heads * layout.head_dim * layout.itemsize
        self.block_stride, self.seg_stride = layout.strides(num_blocks)  # either order: see kvpool.layout
        with cupy.cuda.Device(device):
            self.error = cupy.zeros(1, dtype=cupy.int32)
        self._slots = _Pinned()
        self._data = _Pinned()

    # --- public: tokens and layers ------------------------------------------------------------------------------

    def move_tokens(self, slots: Any, data: Any, to_pool: bool, stream: Any) -> None:
        info = describe(data)
        n = self._num_tokens(slots)
        self._check(info, (n, *self.layout.token_shape), "data", 4)
        with cupy.cuda.Device(self.device):
            s = resolve_stream(stream, (slots, data))
            if info.device is None:
                self._host_tokens(slots, info, n, to_pool, s)
                return
            slots_ptr, slot_dtype = self._device_slots(slots, s)
            self._launch(slots_ptr, slot_dtype, n, 2 * self.layout.num_layers, info.ptr, info.ptr + self.row_bytes,
                         info.strides[0], info.strides[0], 0, to_pool, s)

    def move_layer(self, layer: int, slots: Any, k: Any, v: Any, to_pool: bool, stream: Any) -> None:
        n = self._num_tokens(slots)
        shape = (n, self.layout.num_kv_heads, self.layout.head_dim)
        ki, vi = describe(k), describe(v)
        self._check(ki, shape, "k", 2)
        self._check(vi, shape, "v", 2)
        if ki.device is None or vi.device is None:
            raise InvalidArgumentError("write_layer/read_layer on a GPU pool take device arrays (CuPy/PyTorch)")
        with cupy.cuda.Device(self.device):
            s = resolve_stream(stream, (slots, k, v))
            slots_ptr, slot_dtype = self._device_slots(slots, s)
            self._launch(slots_ptr, slot_dtype, n, 2, ki.ptr, vi.ptr, ki.strides[0], vi.strides[0], 2 * layer,
                         to_pool, s)

    def check_slot_errors(self) -> None:
        with cupy.cuda.Device(self.device):
            flag = int(self.error.get()[0])  # synchronizes
            if flag:
                self.error.fill(0)
                raise InvalidArgumentError(f"a kernel was given slots outside [0, {self.num_slots}); they were "
                                           "skipped")

    # --- helpers ------------------------------------------------------------------------------------------------

    def _launch(self, slots_ptr: int, slot_dtype: str, n: int, rows: int, dense_k: int, dense_v: int,
                stride_k: int, stride_v: int, first_seg: int, to_pool: bool, stream: Any) -> None:
        slot_kernels.launch(pool_ptr=self.pool_ptr, dense_k=dense_k, dense_v=dense_v, stride_k=stride_k,
                            stride_v=stride_v, slots_ptr=slots_ptr, slot_dtype=slot_dtype, num_tokens=n,
                            rows_per_token=rows, row_bytes=self.row_bytes, num_slots=self.num_slots,
                            block_size=self.layout.block_size, block_stride=self.block_stride,
                            seg_stride=self.seg_stride, first_seg=first_seg, error_ptr=self.error.data.ptr,
                            to_pool=to_pool, stream=stream)

    def _num_tokens(self, slots: Any) -> int:
        shape = getattr(slots, "shape", None)
        if shape is None:
            slots = np.asarray(slots)
            shape = slots.shape
        if len(shape) != 1:
            raise InvalidArgumentError(f"slots must be 1-d, got shape {tuple(shape)}")
        return int(shape[0])

    def _check(self, info: ArrayInfo, shape: tuple[int, ...], name: str, inner: int) -> None:
        if tuple(info.shape) != shape:
            raise InvalidArgumentError(f"{name} must have shape {shape}, got {tuple(info.shape)}")
        if info.dtype not in ACCEPTED_DTYPES[self.layout.dtype]:
            raise InvalidArgumentError(f"{name} must be {' or '.join(ACCEPTED_DTYPES[self.layout.dtype])} for a "
                                       f"{self.layout.dtype} pool, got {info.dtype}")
        if info.device is not None and info.device != self.device:
            raise InvalidArgumentError(f"{name} is on cuda:{info.device}, the pool on cuda:{self.device}")
        # Device arrays are read in place by the kernel: rows must be contiguous. Host data is copied into pinned
        # staging anyway, so any strides do (as on a host pool); a host ``out`` is checked in _host_tokens.
        if shape[0] and info.device is not None and not info.inner_contiguous(inner):
            raise InvalidArgumentError(f"{name}'s last {inner} dimensions must be contiguous (strides "
                                       f"{info.strides}); the first may have any stride")

    def _device_slots(self, slots: Any, stream: Any) -> tuple[int, str]:
        """(pointer, dtype) of the slots on the device: device slots as they are, host slots uploaded (checked)."""
        if hasattr(slots, "__cuda_array_interface__") or (is_torch(slots) and slots.is_cuda):
            info = describe(slots)
            if info.dtype not in ("int32", "int64"):
                raise InvalidArgumentError(f"slots must be int32 or int64, got {info.dtype}")
            if info.device != self.device:
                raise InvalidArgumentError(f"slots are on cuda:{info.device}, the pool on cuda:{self.device}")
            if info.shape[0] > 1 and info.strides[0] != info.itemsize:
                raise InvalidArgumentError("device slots must be contiguous")
            return info.ptr, info.dtype
        host = self.checked_host_slots(slots)
        self._slots.reserve(host.nbytes)
        self._slots.host_array(host.nbytes)[:] = host.view(np.uint8)
        cupy.cuda.runtime.memcpyAsync(self._slots.device.ptr, self._slots.host.ptr, host.nbytes, _H2D, stream.ptr)
        self._slots.ready = stream.record()
        return self._slots.device.ptr, "int64"

    def checked_host_slots(self, slots: Any) -> np.ndarray:
        arr = to_numpy(slots).reshape(-1)
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise InvalidArgumentError(f"slots must be integers, got {arr.dtype}")
        arr = np.ascontiguousarray(arr, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= self.num_slots):
            raise InvalidArgumentError(f"slots must lie in [0, {self.num_slots}), got [{arr.min()}, {arr.max()}]")
        return arr

    def _host_tokens(self, slots: Any, info: ArrayInfo, n: int, to_pool: bool, stream: Any) -> None:
        """Host data <-> pool through pinned staging; synchronous. The host array may have any strides: it is
        copied into (out of) the pinned buffer element-wise, as a host pool's NumPy indexing copies it."""
        data = to_numpy(info.obj)  # a PyTorch CPU tensor shares its memory (bfloat16 as its uint16 bits)
        nbytes = n * self.layout.token_bytes
        slots_ptr, slot_dtype = self._device_slots(slots, stream)
        self._data.reserve(nbytes)
        staging = self._data.device.ptr
        if to_pool:
            self._data.host_array(nbytes).view(data.dtype).reshape(data.shape)[...] = data
            cupy.cuda.runtime.memcpyAsync(staging, self._data.host.ptr, nbytes, _H2D, stream.ptr)
        tb = self.layout.token_bytes
        self._launch(slots_ptr, slot_dtype, n, 2 * self.layout.num_layers, staging, staging + self.row_bytes, tb, tb,
                     0, to_pool, stream)
        if not to_pool:
            cupy.cuda.runtime.memcpyAsync(self._data.host.ptr, staging, nbytes, _D2H, stream.ptr)
        stream.synchronize()
        if not to_pool:
            data[...] = self._data.host_array(nbytes).view(data.dtype).reshape(data.shape)
