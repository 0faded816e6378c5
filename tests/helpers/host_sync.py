"""A check that a piece of torch code never makes the host wait for the device: what a CUDA graph
cannot capture (a value read back, an output sized by the data, a copy to the CPU)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Ops that read a device value on the host: a scalar (.item(), int(t), bool(t)), or the data that
# sizes their output (bincount on CUDA reads the maximum, nonzero/unique/masked_select count).
_READS_BACK = {
    aten._local_scalar_dense,
    aten.nonzero,
    aten.bincount,
    aten.unique_consecutive,
    aten.unique_dim,
    aten._unique,
    aten._unique2,
    aten.masked_select,
    aten.repeat_interleave,
}
_COPIES = {aten._to_copy, aten.copy_}


class HostSyncError(AssertionError):
    """An op that synchronises the host with the device ran inside `NoHostSync`."""


# torch's TorchDispatchMode is unannotated
class NoHostSync(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Raises HostSyncError on every op that reads device data on the host, and on copies from a
    device to the CPU. On a CPU the copies cannot be told apart (and `.tolist()` dispatches no op):
    run the code on the meta device too, where every read of data fails."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func.overloadpacket in _READS_BACK:
            raise HostSyncError(f"{func} waits for the device (reads its data on the host)")
        if func.overloadpacket in _COPIES and _to_cpu(func, args, kwargs):
            raise HostSyncError(f"{func} copies a device tensor to the CPU")
        return func(*args, **kwargs)


def _to_cpu(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if func.overloadpacket is aten.copy_:
        destination, source = args[0], args[1]
    else:
        source = args[0]
        device = kwargs.get("device")
        destination = source if device is None else torch.empty(0, device=device)
    return bool(destination.device.type == "cpu" and source.device.type != "cpu")
