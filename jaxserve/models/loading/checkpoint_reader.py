"""A safetensors checkpoint's tensors, read by name from several threads at once: to the device
through a bounded set of reusable host buffers, or to the host as numpy arrays.

``checkpoint_loader.load_weights`` asks for tensors here. Each file's header (an 8-byte length, then
JSON: dtype, shape and byte offsets of every tensor) is parsed on first use, so a tensor's shape
and dtype are known before any of its bytes are read. ``read_to_device`` copies a tensor's bytes
with ``os.preadv`` (which releases the GIL) into one of ``num_buffers`` host buffers of
``buffer_bytes``, one buffer-full at a time, and hands each piece to ``jax.device_put``; a
buffer goes back to the pool once its piece is on the device, so host memory stays at
``num_buffers x buffer_bytes`` whatever the size of the checkpoint or of one tensor. The caller
joins the pieces on the device. ``read_to_host`` gives a tensor as a numpy array of its own (the
pre-quantized formats, converted on the host).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import queue
import struct
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

MiB = 1024**2
MAX_HEADER_BYTES = 100 * MiB  # safetensors' own limit

# safetensors' dtype names -> numpy (bf16 and fp8 from ml_dtypes, as jax reads them).
DTYPES: dict[str, Any] = {
    "BOOL": np.bool_,
    "U8": np.uint8,
    "I8": np.int8,
    "U16": np.uint16,
    "I16": np.int16,
    "U32": np.uint32,
    "I32": np.int32,
    "U64": np.uint64,
    "I64": np.int64,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F32": np.float32,
    "F64": np.float64,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
}


class WeightsError(ValueError):
    """A checkpoint that does not match its config: names the file and the tensor."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file: its bytes are ``[begin, end)`` of ``file``."""

    name: str
    file: Path
    dtype_name: str  # safetensors' name: BF16, F32, F8_E4M3, ...
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def num_bytes(self) -> int:
        return self.end - self.begin

    @property
    def dtype(self) -> np.dtype:
        if self.dtype_name not in DTYPES:
            raise WeightsError(
                f"{self.file.name}: tensor {self.name!r} has dtype {self.dtype_name}; "
                f"one of {', '.join(DTYPES)} is read"
            )
        return np.dtype(DTYPES[self.dtype_name])


def read_header(file: Path) -> dict[str, TensorInfo]:
    """Tensor name -> where it lies in ``file``, checked against the file's size."""
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(8)
        (length,) = struct.unpack("<Q", head) if len(head) == 8 else (size,)
        if 8 + length > size or length > MAX_HEADER_BYTES:
            raise WeightsError(
                f"{file}: not a safetensors file (a header of {length} bytes in {size}; "
                f"at most {MAX_HEADER_BYTES} are read)"
            )
        text = f.read(length)
    try:
        header = json.loads(text)
        infos = {
            name: _tensor_info(file, name, entry, 8 + length, size)
            for name, entry in header.items()
            if name != "__metadata__"
        }
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, WeightsError):
            raise
        raise WeightsError(f"{file}: not a safetensors file (its header: {exc!r})") from exc
    return infos


def _tensor_info(file: Path, name: str, entry: dict, data_start: int, size: int) -> TensorInfo:
    begin, end = (data_start + int(offset) for offset in entry["data_offsets"])
    shape = tuple(int(n) for n in entry["shape"])
    info = TensorInfo(name, file, str(entry["dtype"]), shape, begin, end)
    itemsize = np.dtype(DTYPES[info.dtype_name]).itemsize if info.dtype_name in DTYPES else 0
    if (
        not data_start <= begin <= end <= size
        or min(shape, default=0) < 0
        or (itemsize and info.num_bytes != math.prod(shape) * itemsize)
    ):
        raise WeightsError(
            f"{file.name}: tensor {name!r} ({info.dtype_name}{list(shape)}) has "
            f"{info.num_bytes} bytes at [{begin}, {end}) of a {size}-byte file"
        )
    return info


# NOTE: plain positioned reads into reused buffers, not safetensors' memory map nor
# fastsafetensors. On the CI machine a copy out of a fresh memory map ran at 0.15 GB/s and
# into freshly allocated memory at 0.3 GB/s (page faults), against 10 GB/s with os.preadv into
# a buffer already touched; the reused buffers also bound host memory. fastsafetensors 0.5
# (pip) builds torch or paddle tensors only: it would bring torch to run time, which jaxserve
# never loads, for the GPUDirect Storage reads that only a cold NVMe read would need.
class CheckpointReader:
    """Reads the tensors of ``files`` (tensor name -> its file); safe to call from threads.

    ``on_read(file, num_bytes)`` is called (from the reading thread) after every piece;
    ``stored_names`` maps a name to the one its file stores it under, where they differ (a
    base model's tensors, without the ``model.`` prefix)."""

    def __init__(
        self,
        files: dict[str, Path],
        on_read: Callable[[Path, int], None] | None = None,
        num_buffers: int = 4,
        buffer_bytes: int = 64 * MiB,
        stored_names: dict[str, str] | None = None,
    ) -> None:
        if num_buffers < 1 or buffer_bytes < 64 or buffer_bytes % 64:
            raise ValueError(
                f"{num_buffers=} must be >= 1 and {buffer_bytes=} a positive multiple of 64"
            )
        self.files = files
        self.stored_names = stored_names or {}
        self.on_read = on_read or (lambda file, num_bytes: None)
        self.num_buffers = num_buffers
        self.buffer_bytes = buffer_bytes
        self._lock = threading.Lock()
        self._headers: dict[Path, dict[str, TensorInfo]] = {}
        self._fds: dict[Path, int] = {}
        self._free: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
        self._num_made = 0

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def info(self, name: str) -> TensorInfo:
        file = self.files[name]
        with self._lock:
            if file not in self._headers:
                if not file.is_file():
                    raise WeightsError(f"{file}: file named by the index for {name!r} not found")
                self._headers[file] = read_header(file)
                self._fds[file] = os.open(file, os.O_RDONLY)
            header = self._headers[file]
        stored = self.stored_names.get(name, name)
        if stored not in header:
            raise WeightsError(f"{file.name}: tensor {name!r}, named by the index, is not in it")
        return header[stored]

    def read_to_host(self, name: str) -> np.ndarray:
        """The tensor as a numpy array of its own."""
        info = self.info(name)
        out = np.empty(info.shape, info.dtype)
        self._read(info, 0, out.reshape(-1).view(np.uint8))
        return out

    def read_to_device(self, names: Sequence[str], device: Any = None) -> list[jax.Array]:
        """The bytes of the tensors ``names`` (one dtype and shape), one after the other, as
        1-D pieces in the checkpoint's dtype on ``device`` (None: the default device,
        uncommitted): ``concatenate(pieces).reshape(len(names), *shape)`` is the stack."""
        infos = [self.info(name) for name in names]
        first = infos[0]
        if any(i.dtype_name != first.dtype_name or i.shape != first.shape for i in infos):
            raise WeightsError(f"{first.file.name}: tensors {list(names)} differ in dtype or shape")
        pieces: list[jax.Array] = []
        sending: list[tuple[np.ndarray, jax.Array]] = []  # at most one buffer in flight
        buffer, filled = None, 0
        try:
            for info in infos:
                done = 0
                while done < info.num_bytes:
                    if buffer is None:
                        buffer, filled = self._take_buffer(sending), 0
                    size = min(info.num_bytes - done, buffer.size - filled)
                    self._read(info, done, buffer[filled : filled + size])
                    done, filled = done + size, filled + size
                    if filled == buffer.size:
                        self._send(buffer, filled, first.dtype, device, pieces, sending)
                        buffer = None
            if buffer is not None and filled:
                self._send(buffer, filled, first.dtype, device, pieces, sending)
                buffer = None
        finally:  # every buffer back in the pool, also after an error (others wait on them)
            if buffer is not None:
                self._free.put(buffer)
            self._finish(sending)
        if not pieces:  # tensors of no elements
            pieces.append(jax.device_put(np.zeros(0, first.dtype), device))
        return pieces

    def _read(self, info: TensorInfo, offset: int, out: np.ndarray) -> None:
        """Bytes ``[offset, offset + out.size)`` of the tensor into ``out`` (u8)."""
        fd = self._fds[info.file]
        done = 0
        while done < out.size:
            num_read = os.preadv(fd, [out[done:]], info.begin + offset + done)
            if num_read <= 0:
                raise WeightsError(f"{info.file.name}: tensor {info.name!r} is cut short")
            done += num_read
        self.on_read(info.file, out.size)

    def _take_buffer(self, sending: list[tuple[np.ndarray, jax.Array]]) -> np.ndarray:
        """A free buffer, a new one while fewer than ``num_buffers`` exist, or this thread's
        own buffer in flight once it has arrived (so no thread waits on another's)."""
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            can_make = self._num_made < self.num_buffers
            self._num_made += can_make
        if can_make:
            return np.empty(self.buffer_bytes, np.uint8)
        if sending:
            buffer, array = sending.pop()
            array.block_until_ready()
            return buffer
        return self._free.get()

    def _send(
        self,
        buffer: np.ndarray,
        filled: int,
        dtype: np.dtype,
        device: Any,
        pieces: list[jax.Array],
        sending: list[tuple[np.ndarray, jax.Array]],
    ) -> None:
        """Send the buffer's first ``filled`` bytes: the buffer is in flight until the next
        send or ``_finish``."""
        array = jax.device_put(buffer[:filled].view(dtype), device, may_alias=False)
        # NOTE: the buffer is reused, so the array must not be its memory; jax 0.11.2's CPU
        # client can keep an aligned numpy array as the array's memory even with
        # may_alias=False (seen with 1 KiB buffers), so such an array is copied.
        on_cpu = next(iter(array.devices())).platform == "cpu"  # (the pointer waits on GPUs)
        if on_cpu and 0 <= array.unsafe_buffer_pointer() - buffer.ctypes.data < filled:
            array = jnp.copy(array)
        self._finish(sending)
        sending.append((buffer, array))
        pieces.append(array)

    def _finish(self, sending: list[tuple[np.ndarray, jax.Array]]) -> None:
        """Wait for the buffer in flight to reach the device, and free it."""
        while sending:
            buffer, array = sending.pop()
            array.block_until_ready()
            self._free.put(buffer)
