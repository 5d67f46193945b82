"""Counting, on a CPU, what would make the host wait for the GPU.

Why: a GPU step is fast only when the host queues its work and reads one result at the end. Every
``.item()``, ``.tolist()``, ``.cpu()``, ``bool(tensor)``, ``nonzero`` or boolean-mask index of a
tensor that lives on the GPU stops the host until the GPU has caught up (a device-to-host
synchronisation); a step with dozens of them leaves the GPU idle between its kernels. None of
this shows on a CPU, where the "device" is the host, so this module makes it visible there.

How: the runner is given :data:`AUDIT_DEVICE` (``cpu:0``, which computes exactly as ``cpu``) as its
device. Inside :class:`SyncAudit`, every tensor made on that device (a factory or ``.to`` naming it)
becomes a :class:`DeviceTensor`; results computed from one stay one (torch's subclass
propagation), and so do the KV cache and everything the forward returns. Host code keeps using
plain tensors, numpy and lists. Each operation on a ``DeviceTensor`` that would force a
synchronisation on CUDA is recorded with its name; a copy to the host returns a plain tensor, so
reading it afterwards costs nothing more, as on a GPU.

    with SyncAudit() as audit:
        engine.step()
    audit.count  # forced device-to-host synchronisations in that step
"""

from __future__ import annotations

import threading
import traceback
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

AUDIT_DEVICE = torch.device("cpu", 0)  # "the GPU" of an audited runner: computes as the CPU does

# methods and functions that return host values or data-dependent shapes: each one waits for the device
_SYNC_NAMES = frozenset({
    "item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "__complex__", "__array__",
    "__format__", "__repr__", "__str__", "nonzero", "argwhere", "unique", "unique_consecutive", "masked_select",
    "equal", "allclose", "is_nonzero", "cpu", "bincount", "histc",
})
# indexing with a boolean mask on the device is a nonzero in disguise
_INDEX_NAMES = frozenset({"__getitem__", "__setitem__", "index_put_", "index_put"})

_state = threading.local()


def _current() -> "SyncAudit | None":
    return getattr(_state, "audit", None)


def _is_device_target(value) -> bool:
    if isinstance(value, torch.device):
        return value == AUDIT_DEVICE
    return isinstance(value, str) and value == "cpu:0"


def _is_host_target(value) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cpu" and value.index is None
    return isinstance(value, str) and value == "cpu"


def _names_device(args, kwargs) -> bool:
    device = kwargs.get("device")
    if device is not None:
        return _is_device_target(device)
    return any(_is_device_target(a) for a in args)


def _to_host(func, args, kwargs) -> bool:
    """``.to("cpu")`` / ``.to(torch.device("cpu"))`` / ``.cpu()``: a copy to the host."""
    if func is torch.Tensor.cpu:
        return True
    if func is torch.Tensor.to:
        device = kwargs.get("device")
        if device is not None:
            return _is_host_target(device)
        return any(_is_host_target(a) for a in args[1:])
    return False


def _bool_device_index(args) -> bool:
    if len(args) < 2:
        return False
    index = args[1]
    items = index if isinstance(index, (tuple, list)) else (index,)
    return any(isinstance(i, DeviceTensor) and i.dtype == torch.bool for i in items)


def _plain(out):
    if isinstance(out, DeviceTensor):
        return out.as_subclass(torch.Tensor)
    if isinstance(out, tuple):
        return tuple(_plain(o) for o in out)
    return out


def _on_device(out):
    if isinstance(out, torch.Tensor) and not isinstance(out, DeviceTensor):
        return out.as_subclass(DeviceTensor)
    if isinstance(out, (tuple, list)):
        return type(out)(_on_device(o) for o in out)
    return out


class DeviceTensor(torch.Tensor):
    """A tensor that lives on the audited runner's device (see the module's docstring)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        audit = _current()
        name = getattr(func, "__name__", str(func))
        if audit is not None:
            if _to_host(func, args, kwargs):
                audit.record(name)
                with torch._C.DisableTorchFunctionSubclass():
                    return _plain(func(*args, **kwargs))
            if name in _SYNC_NAMES or (name in _INDEX_NAMES and _bool_device_index(args)):
                audit.record(name)
            elif name == "copy_" and args and not isinstance(args[0], DeviceTensor):
                audit.record("copy_ to host")
            elif name == "repeat_interleave" and "output_size" not in kwargs and any(
                    isinstance(a, DeviceTensor) for a in args[1:2]):
                audit.record(name)
        return super().__torch_function__(func, types, args, kwargs)


@dataclass
class SyncAudit(TorchFunctionMode):
    """While active on this thread: tensors made on :data:`AUDIT_DEVICE` are :class:`DeviceTensor`
    and the synchronisations they would force are recorded (``events``: name and the caller's
    source line)."""

    events: list[tuple[str, str]] = field(default_factory=list)

    def __post_init__(self):
        super().__init__()

    @property
    def count(self) -> int:
        return len(self.events)

    def reset(self) -> None:
        self.events.clear()

    def record(self, name: str) -> None:
        frame = next((f for f in reversed(traceback.extract_stack()[:-3])
                      if "sync_audit" not in f.filename and "/torch/" not in f.filename), None)
        where = f"{frame.filename.rsplit('/', 2)[-2:]}:{frame.lineno} {frame.line}" if frame else "?"
        self.events.append((name, where))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _names_device(args, kwargs) and not _to_host(func, args, kwargs):
            return _on_device(out)
        return out

    def __enter__(self):
        self._previous = _current()
        _state.audit = self
        return super().__enter__()

    def __exit__(self, *exc):
        _state.audit = self._previous
        return super().__exit__(*exc)


__all__ = ["AUDIT_DEVICE", "DeviceTensor", "SyncAudit"]
