"""The data path: moving K/V between a caller's arrays and the pool, and attention that reads the pool in place.

    reference.py         NumPy: every operation, the host backend's implementation and the tests' oracle
    arrays.py            what a caller's array is (NumPy / CuPy / PyTorch / CUDA array interface), no imports
    slot_kernels.py      CuPy RawKernel: rows between dense arrays and slots (whole tokens or one layer)
    device_path.py       AttachedPool's GPU calls: checks, streams, pinned staging, launches
    paged_attention.py   decode attention through block tables (Triton on CUDA, PyTorch on the CPU), prefill
    torch_views.py       the pool as PyTorch tensors: per-layer [num_blocks, block_size, H, D] K/V, zero-copy

Only ``reference`` and ``arrays`` import at package import time; the rest import CuPy, PyTorch or Triton.
"""
