"""attach(): the server's pool mapped into this process, without a copy.

    server process                              this process
    +-------------------------------+           +--------------------------------------+
    | pool (cudaMalloc or /dev/shm) | <-------> | AttachedPool.blocks                  |
    +-------------------------------+   same    |   [num_blocks, L, 2, block_size, H, D]|
          DescribePool: layout +        memory  | layer_kv(l) -> K, V views            |
          shm_name / CUDA IPC handle            | write_slots(slots, kv) / read_slots  |
                                                | write_layer(l, slots, k, v) / read_layer|
                                                +--------------------------------------+

Data calls on a GPU pool take CuPy arrays or PyTorch tensors and run one kernel on the caller's stream without
waiting (``kvpool_client.kernels.device_path`` says when to synchronize); NumPy data goes through pinned staging.

The host backend maps POSIX shared memory (NumPy views); the GPU backend opens the CUDA IPC handle through CuPy
(CuPy views). CuPy is imported only on the GPU path, so the client imports without it.

Write only into slots that AppendToken just returned for your own sequences: the server has already run any
copy-on-write copy, so those blocks are yours alone. Views taken from ``blocks`` die with ``close()``.
"""

from __future__ import annotations

import os

from typing import TYPE_CHECKING, Any

import numpy as np

from kvpool import layout as kvlayout
from kvpool_client.errors import AttachNotAllowedError, InvalidArgumentError, PoolNotMappableError, ServerGoneError
from kvpool_client.kernels import reference
from kvpool_client.kernels.arrays import ACCEPTED_DTYPES, is_torch, to_numpy

if TYPE_CHECKING:
    from kvpool_client.session import SessionState
    from kvpool_client.types import PoolDescription


class AttachedPool:
    """The pool of one server, mapped into this process. A context manager; ``close()`` unmaps it."""

    def __init__(self, description: PoolDescription, mapped: Any, liveness: ServerLiveness | None = None) -> None:
        self.description = description
        self._liveness = liveness
        self.layout = description.layout
        self.num_blocks = description.num_blocks
        self.backend = description.backend
        self._mapped = mapped
        flat = mapped.flat
        if flat.dtype != self.layout.storage_dtype:
            flat = flat.view(self.layout.storage_dtype)
        self._blocks = kvlayout.blocks_view(flat, self.layout, self.num_blocks)
        self._xp = np if isinstance(self._blocks, np.ndarray) else _cupy()
        self._device: Any = None  # the GPU data path (kvpool_client.kernels.device_path), None on a host pool
        if self._xp is not np:
            self._xp.cuda.Device(description.cuda_device).use()  # the pool's device for every later kernel
            from kvpool_client.kernels.device_path import DevicePath  # noqa: PLC0415  (imports CuPy)

            self._device = DevicePath(int(self._blocks.data.ptr), self.layout, self.num_blocks,
                                      description.cuda_device)

    @property
    def closed(self) -> bool:
        return self._mapped is None

    @property
    def blocks(self) -> Any:
        """The whole pool as [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim] (NumPy or CuPy)."""
        if self._mapped is None:
            raise ValueError("the pool is closed")
        return self._blocks

    def layer_kv(self, layer: int) -> tuple[Any, Any]:
        """Zero-copy K and V of one layer, each [num_blocks, block_size, num_kv_heads, head_dim] (the paged cache
        shape of vLLM/FlashInfer kernels and ``kvpool_client.kernels.paged_attention``)."""
        if not 0 <= layer < self.layout.num_layers:
            raise IndexError(f"layer {layer} is outside 0..{self.layout.num_layers - 1}")
        return kvlayout.layer_kv(self.blocks, layer)

    def _check_slots(self, slots: Any) -> np.ndarray:
        if hasattr(slots, "__cuda_array_interface__"):
            raise InvalidArgumentError("the pool is in host memory: pass slots as a host array")
        slots = to_numpy(slots)
        if slots.size and not np.issubdtype(slots.dtype, np.integer):
            raise InvalidArgumentError(f"slots must be integers, got {slots.dtype}")
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        limit = self.num_blocks * self.layout.block_size
        if slots.size and (slots.min() < 0 or slots.max() >= limit):
            raise InvalidArgumentError(f"slots must lie in [0, {limit}), got [{slots.min()}, {slots.max()}]")
        return slots

    def _host_array(self, x: Any, shape: tuple[int, ...], name: str) -> np.ndarray:
        if hasattr(x, "__cuda_array_interface__") or (is_torch(x) and x.is_cuda):
            raise InvalidArgumentError(f"the pool is in host memory: pass {name} as a host array, not a device one")
        x = to_numpy(x)
        if tuple(x.shape) != shape:
            raise InvalidArgumentError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
        if x.dtype.name not in ACCEPTED_DTYPES[self.layout.dtype]:
            raise InvalidArgumentError(f"{name} must be {self.layout.storage_dtype} for a {self.layout.dtype} pool, "
                                       f"got {x.dtype}")
        return x

    def check_live(self, what: str = "read") -> None:
        """Raise ``ServerGoneError`` / ``SessionLostError`` as ``read_slots`` would: before raw-view copies that must
        not touch a pool no live server holds (the check ``write_slots`` and the others make first)."""
        self._check_server(what)

    def _check_server(self, what: str = "write") -> None:
        if self._liveness is not None:
            self._liveness.check(what)

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.layout.num_layers:
            raise InvalidArgumentError(f"layer {layer} is outside 0..{self.layout.num_layers - 1}")

    def write_slots(self, slots: Any, data: Any, *, stream: Any = None) -> None:
        """Write whole tokens' KV ``data`` [n, num_layers, 2, num_kv_heads, head_dim] into ``slots`` [n].

        Host pool: NumPy semantics, done on return. GPU pool: ``data`` on the device (CuPy array, PyTorch tensor)
        is moved by one kernel enqueued on ``stream`` and the call returns at once -- synchronize the stream before
        another process reads the slots; ``data`` in host memory (NumPy) goes through pinned staging and the call
        returns when it is in the pool. Slots: host or device int32/int64 (see ``check_slot_errors``).

        Raises ServerGoneError (or SessionLostError) once the server is gone or this client's session has ended:
        the memory is no longer a live server's, or its blocks may be someone else's now."""
        self._check_server()
        if self._device is not None:
            self._device.move_tokens(slots, data, True, stream)
            return
        slots = self._check_slots(slots)
        data = self._host_array(data, (slots.size, *self.layout.token_shape), "data")
        reference.write_tokens(self.blocks, slots, data.view(self.layout.storage_dtype))

    def read_slots(self, slots: Any, *, out: Any = None, stream: Any = None) -> Any:
        """The KV at ``slots`` as [n, num_layers, 2, num_kv_heads, head_dim].

        Without ``out``: a new host (NumPy) array, complete on return. With ``out`` (GPU pool: a device array of
        that shape, or a host array): filled and returned; a device ``out`` is filled asynchronously on ``stream``.
        Refuses like ``write_slots`` once the server or the session is gone: the slots may hold someone else's KV."""
        self._check_server("read")
        if self._device is not None:
            if out is None:
                n = self._device.checked_host_slots(slots).size if not _on_device(slots) else len(slots)
                out = np.empty((n, *self.layout.token_shape), dtype=self.layout.storage_dtype)
            self._device.move_tokens(slots, out, False, stream)
            return out
        slots = self._check_slots(slots)
        result = reference.read_tokens(self.blocks, slots)
        if out is None:
            return result
        self._host_array(out, result.shape, "out")[...] = result
        return out

    def write_layer(self, layer: int, slots: Any, k: Any, v: Any, *, stream: Any = None) -> None:
        """Write one layer's new K and V, each [n, num_kv_heads, head_dim], into ``slots`` [n] -- what a frontend
        does after each attention layer (vLLM's ``reshape_and_cache``). The first dimension of ``k``/``v`` may
        have any stride (views of a fused QKV output are fine); GPU pool: asynchronous on ``stream``. Refuses
        like ``write_slots`` once the server or the session is gone."""
        self._check_server()
        self._check_layer(layer)
        if self._device is not None:
            self._device.move_layer(layer, slots, k, v, True, stream)
            return
        slots = self._check_slots(slots)
        shape = (slots.size, self.layout.num_kv_heads, self.layout.head_dim)
        k, v = self._host_array(k, shape, "k"), self._host_array(v, shape, "v")
        dtype = self.layout.storage_dtype
        reference.write_layer(self.blocks, layer, slots, k.view(dtype), v.view(dtype))

    def read_layer(self, layer: int, slots: Any, *, out: tuple[Any, Any] | None = None,
                   stream: Any = None) -> tuple[Any, Any]:
        """One layer's K and V at ``slots``, each [n, num_kv_heads, head_dim]: NumPy copies on a host pool; on a
        GPU pool new CuPy arrays (or ``out``'s device arrays), filled asynchronously on ``stream``. Refuses like
        ``read_slots``."""
        self._check_server("read")
        self._check_layer(layer)
        if self._device is not None:
            if out is None:
                cp = self._xp
                n = self._device.checked_host_slots(slots).size if not _on_device(slots) else len(slots)
                shape = (n, self.layout.num_kv_heads, self.layout.head_dim)
                with cp.cuda.Device(self.description.cuda_device):
                    out = (cp.empty(shape, self.layout.storage_dtype), cp.empty(shape, self.layout.storage_dtype))
            self._device.move_layer(layer, slots, out[0], out[1], False, stream)
            return out
        slots = self._check_slots(slots)
        k, v = reference.read_layer(self.blocks, layer, slots)
        if out is None:
            return k, v
        shape = k.shape
        self._host_array(out[0], shape, "out[0]")[...] = k
        self._host_array(out[1], shape, "out[1]")[...] = v
        return out

    def check_slot_errors(self) -> None:
        """Raise ``InvalidArgumentError`` if a kernel since the last check was given device slots outside the pool
        (they were skipped). Synchronizes the device. A no-op on the host pool (slots are checked up front)."""
        if self._device is not None:
            self._device.check_slot_errors()

    def close(self) -> None:
        """Drop this object's views and unmap the pool (idempotent)."""
        if self._mapped is None:
            return
        mapped, self._mapped, self._blocks, self._device = self._mapped, None, None, None
        mapped.close()

    def __enter__(self) -> AttachedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _on_device(x: Any) -> bool:
    return hasattr(x, "__cuda_array_interface__") or (is_torch(x) and x.is_cuda)


class ServerLiveness:
    """Whether writes into the mapping still reach a live server's pool for a live session: the server's process
    exists (a signal-0 probe of ``server_pid``: the mapping needs the server's pid namespace anyway, for CUDA IPC
    too), the client's keep-alive has not found its session lost, and the server acknowledged something of the
session within its lease (``SessionState.check_lease``, session.py). About a microsecond a check."""

    def __init__(self, server_pid: int, session: SessionState) -> None:
        self.server_pid = server_pid
        self.session = session

    def check(self, what: str) -> None:
        self.session.check_live(what)
        self.session.check_lease(what)
        try:
            os.kill(self.server_pid, 0)
        except ProcessLookupError:
            raise ServerGoneError(f"kvpool-server (pid {self.server_pid}) is gone: refusing to {what} into the "
                                  "mapping of its pool, which no server holds any more", method="AttachedPool") from None
        except PermissionError:
            pass  # alive, another user's


def _cupy() -> Any:
    import cupy  # noqa: PLC0415  (lazy: the client installs without CuPy)

    return cupy


NOT_ALLOWED = (
    "this tenant may not attach the pool: the server (--auth-tokens) sends the pool's shared-memory name or CUDA IPC "
    "handle only to tenants whose [tenants.NAME] section in the tokens file says may_attach = true (mapping the pool "
    "shows every tenant's KV). Move KV through client.write_kv() / client.read_kv() instead, or ask the operator to "
    "grant may_attach (docs/security.md)")


def attach(description: PoolDescription, session: SessionState) -> AttachedPool:
    """Map the pool ``description`` (DescribePool's) names: shared memory on the host backend, CUDA IPC through CuPy
    on a GPU; its writes and reads check the server's process and ``session`` first (``ServerLiveness``).
    AttachNotAllowedError when the description carries no mapping: the caller's tenant lacks ``may_attach``."""
    from kvpool_client import mapping  # noqa: PLC0415  (mapping imports CuPy lazily on the GPU path)

    if description.backend in ("host", "gpu") and not (description.shm_name or description.cuda_ipc_handle):
        raise AttachNotAllowedError(NOT_ALLOWED, code=AttachNotAllowedError.code, method="DescribePool")
    if description.backend not in ("host", "gpu"):
        raise InvalidArgumentError(f"the server reports backend {description.backend!r}; cannot attach")
    try:
        if description.backend == "host":
            mapped = mapping.map_host_pool(description.shm_name, description.pool_bytes)
        else:
            mapped = mapping.map_gpu_pool(description.cuda_ipc_handle, description.pool_bytes, description.cuda_device)
    except (OSError, RuntimeError) as error:  # no such segment here; a CUDA IPC handle of another host or container
        where = (f"shared-memory segment /{description.shm_name}" if description.backend == "host"
                 else f"CUDA IPC handle (device {description.cuda_device})")
        raise PoolNotMappableError(
            f"cannot map the pool's {where} from this process ({type(error).__name__}: {error}): the server "
            f"(pid {description.server_pid}) is on another host, or in another container or IPC namespace. Move KV "
            "through client.write_kv() / client.read_kv() instead, or run in the server's IPC namespace (docker: "
            "--ipc container:SERVER)", method="attach") from error
    return AttachedPool(description, mapped, ServerLiveness(description.server_pid, session))
