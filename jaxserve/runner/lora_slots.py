"""LoraSlots: which adapter sits in which device slot, the adapters kept in host memory, and the
device stacks (``models/lora.py``) the model step reads.

Adapters arrive as ``LoRARequest``s (``add_lora``: read from disk and checked by
``loading/peft_adapter.py``, kept in host memory, least recently used out past
``--max-cpu-loras``; one needed again is read again). The scheduler ``acquire``s a slot for each
sequence it admits with an adapter and ``release``s it when the sequence is preempted or
finishes: an adapter already in a slot shares it; else it goes into a free slot, or in place of
the least recently used adapter that no running sequence holds; with every slot held, ``acquire``
says no and the sequence waits. Writing a slot updates the stacks with a jitted, donated
``.at[slot].set`` compiled once at start-up, so loading an adapter compiles nothing; a step
already dispatched keeps reading the arrays it was given. ``remove_lora`` (unload, or a
replacement under the same name with a new id) frees the slot once its last sequence releases it.

Slot numbers are those the per-token inputs carry: 0 is the base model, 1..M the stacks' rows.
``add_lora`` may run on the server's thread while the engine thread acquires: a lock guards the
tables; the disk read happens outside it.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.lora_request import LoRARequest
from jaxserve.models import lora
from jaxserve.models.loading.peft_adapter import HostAdapter, load_adapter


def _write_slot(stacks: lora.LoraWeights, row: jax.Array, slot: lora.LoraWeights) -> Any:
    """``stacks`` with row ``row`` of every stack replaced by ``slot``'s arrays."""
    return jax.tree.map(lambda stack, value: stack.at[row].set(value), stacks, slot)


@dataclasses.dataclass
class _Slot:
    lora_int_id: int | None = None  # the adapter in it; None: free
    num_refs: int = 0  # running sequences that hold it
    last_used: int = 0  # a tick of LoraSlots' clock (least recently used out first)


class LoraSlots:
    def __init__(
        self,
        shapes: lora.LoraShapes,
        dtype: Any,
        max_cpu_loras: int,
        put: Any = None,
        shardings: Any = None,
    ) -> None:
        """``put``: places host arrays as the step expects them (``jax.device_put``);
        ``shardings``: a ``LoraWeights`` of shardings under tensor parallelism
        (``parallel/sharding.py``'s ``lora_shardings``), the stacks split as their base
        projections are, written in place in their shards."""
        self.shapes = shapes
        self.dtype = dtype
        self.max_cpu_loras = max_cpu_loras
        self.shardings = shardings
        if shardings is not None and put is None:
            put = functools.partial(jax.device_put, device=shardings)
        self._put = put or jax.device_put
        out = {} if shardings is None else {"out_shardings": shardings}
        self._write = jax.jit(_write_slot, donate_argnums=0, **out)
        if shardings is None:
            self.weights: lora.LoraWeights = self._put(lora.zeros(shapes, dtype))
        else:  # allocated in their shards: no device holds all of them
            self.weights = jax.jit(lambda: lora.zeros(shapes, dtype), out_shardings=shardings)()
        # Compile the write now (into row 0, zeros again): no adapter load compiles.
        self.weights = self._write(self.weights, np.int32(0), self._slot_arrays(None))
        self._slots = [_Slot() for _ in range(shapes.num_slots)]  # slot s is _slots[s - 1]
        self._host: collections.OrderedDict[int, HostAdapter] = collections.OrderedDict()
        self._known: dict[int, LoRARequest] = {}
        self._retired: set[int] = set()  # removed while running: freed on the last release
        self._clock = itertools.count(1)
        self._lock = threading.Lock()
        self.num_loads = 0  # adapters written into a slot (tests, metrics)

    # -- adapters ---------------------------------------------------------------------------

    def add_lora(self, request: LoRARequest) -> HostAdapter:
        """Read and check the adapter (``AdapterError`` if it does not fit; nothing changes)
        and keep it in host memory."""
        adapter = load_adapter(request.lora_path, self.shapes)
        with self._lock:
            self._known[request.lora_int_id] = request
            self._retired.discard(request.lora_int_id)
            self._keep_host(request.lora_int_id, adapter)
        return adapter

    def has_lora(self, lora_int_id: int) -> bool:
        with self._lock:
            return lora_int_id in self._known

    def remove_lora(self, lora_int_id: int) -> None:
        """Forget the adapter: its slot is freed now, or when its last sequence finishes."""
        with self._lock:
            self._known.pop(lora_int_id, None)
            self._host.pop(lora_int_id, None)
            for slot in self._slots:
                if slot.lora_int_id == lora_int_id:
                    if slot.num_refs:
                        self._retired.add(lora_int_id)
                    else:
                        slot.lora_int_id = None

    def _keep_host(self, lora_int_id: int, adapter: HostAdapter) -> None:
        self._host[lora_int_id] = adapter
        self._host.move_to_end(lora_int_id)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)

    # -- slots (the scheduler, on the engine thread) ---------------------------------------

    def acquire(self, request: LoRARequest) -> int | None:
        """The slot (1..M) holding ``request``'s adapter, now held once more by a sequence;
        None when every slot is held by running sequences (the sequence waits)."""
        with self._lock:
            index = self._find(request.lora_int_id)
            if index is None:
                index = self._victim()
                if index is None:
                    return None
                self._load(index, request)
            slot = self._slots[index]
            slot.num_refs += 1
            slot.last_used = next(self._clock)
            return index + 1

    def release(self, slot_number: int) -> None:
        """A sequence holding slot ``slot_number`` (1..M) stopped running."""
        with self._lock:
            slot = self._slots[slot_number - 1]
            slot.num_refs -= 1
            assert slot.num_refs >= 0, f"slot {slot_number} released more often than acquired"
            if slot.num_refs == 0 and slot.lora_int_id in self._retired:
                self._retired.discard(slot.lora_int_id)
                slot.lora_int_id = None

    def _find(self, lora_int_id: int) -> int | None:
        for i, slot in enumerate(self._slots):
            if slot.lora_int_id == lora_int_id and lora_int_id not in self._retired:
                return i
        return None

    def _victim(self) -> int | None:
        """A free slot, else the least recently used one no sequence holds."""
        free = [i for i, s in enumerate(self._slots) if s.num_refs == 0]
        if not free:
            return None
        empty = [i for i in free if self._slots[i].lora_int_id is None]
        return empty[0] if empty else min(free, key=lambda i: self._slots[i].last_used)

    def _load(self, index: int, request: LoRARequest) -> None:
        adapter = self._host.get(request.lora_int_id)
        if adapter is None:  # evicted from host memory (or never added): read it again
            adapter = load_adapter(request.lora_path, self.shapes)
            self._known[request.lora_int_id] = request
        self._keep_host(request.lora_int_id, adapter)
        self.weights = self._write(self.weights, np.int32(index), self._slot_arrays(adapter))
        self._slots[index].lora_int_id = request.lora_int_id
        self.num_loads += 1

    def _slot_arrays(self, adapter: HostAdapter | None) -> lora.LoraWeights:
        """One slot's arrays in the stacks' dtype (zeros for None), as a ``LoraWeights``."""
        layers = []
        for i in range(len(self.shapes.dims)):
            shapes = self.shapes.layer_arrays(i)
            arrays = {
                name: np.zeros(shape[1:], np.float32)
                if adapter is None
                else adapter.layers[i][name]
                for name, shape in shapes.items()
            }
            fields = {
                f.name: None if f.name not in arrays else jnp.asarray(arrays[f.name], self.dtype)
                for f in dataclasses.fields(lora.LoraLayer)
            }
            layers.append(lora.LoraLayer(**fields))  # type: ignore[arg-type]
        return lora.LoraWeights(layers)

    # -- what runs --------------------------------------------------------------------------

    def slot_names(self) -> dict[int, str]:
        """Slot number -> the name of the adapter in it."""
        with self._lock:
            return {
                i + 1: self._known[s.lora_int_id].lora_name
                for i, s in enumerate(self._slots)
                if s.lora_int_id is not None and s.lora_int_id in self._known
            }

    @property
    def num_host_adapters(self) -> int:
        return len(self._host)
