"""Padded batches: many variable-length items as one padded array, and back.

``collate`` pads a list of arrays (or torch tensors) along their first axis (time) to the longest
and returns a ``Batch`` with ``data`` (B, T_max, ...), ``lengths`` (B,), ``mask`` (B, T_max; True on
real frames) and ``keys``. ``unbatch`` cuts a batched model output back into one array per item.
torch inputs give torch outputs (on the inputs' device); anything else gives numpy.

``plan_batches`` is how a shard groups its keys: by count, by seconds (dynamic batches, like
lhotse's or ESPnet's numel batching), optionally sorted by length to cut padding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Batch:
    data: Any  # (B, T_max, ...) padded with ``pad_value``
    lengths: Any  # (B,) int64: each item's length along the first axis
    mask: Any  # (B, T_max) bool: True where data holds an item's frames
    keys: list = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.lengths)


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def collate(items: list, keys: list | None = None, pad_value=0) -> Batch:
    """Pad ``items`` (same dtype and trailing shape, any first-axis length) to the longest one."""
    if not items:
        raise ValueError("collate: no items")
    if _is_torch(items[0]):
        import torch

        lengths = torch.tensor([len(x) for x in items], dtype=torch.int64)
        data = torch.nn.utils.rnn.pad_sequence(list(items), batch_first=True, padding_value=pad_value)
        mask = torch.arange(data.shape[1], device=data.device)[None, :] < lengths.to(data.device)[:, None]
        return Batch(data, lengths.to(data.device), mask, list(keys or []))
    import numpy as np

    arrays = [np.asarray(x) for x in items]
    tail = arrays[0].shape[1:]
    for i, a in enumerate(arrays):
        if a.shape[1:] != tail or a.dtype != arrays[0].dtype:
            name = keys[i] if keys else f"#{i}"
            raise ValueError(f"collate: item {name!r} is {a.dtype} {a.shape}, the first is "
                             f"{arrays[0].dtype} {arrays[0].shape}: only the first axis may differ")
    lengths = np.array([len(a) for a in arrays], dtype=np.int64)
    data = np.full((len(arrays), int(lengths.max()), *tail), pad_value, dtype=arrays[0].dtype)
    for i, a in enumerate(arrays):
        data[i, :len(a)] = a
    mask = np.arange(data.shape[1])[None, :] < lengths[:, None]
    return Batch(data, lengths, mask, list(keys or []))


def unbatch(outputs, lengths) -> list:
    """``outputs[i, :lengths[i]]`` for each item: per-item arrays (or tensors) again."""
    return [outputs[i, :int(n)] for i, n in enumerate(lengths)]


def plan_batches(lengths: list[float], *, batch_size: int | None = None, batch_seconds: float | None = None,
                 sort_by_length: bool = False) -> list[list[int]]:
    """Index lists of the batches a shard runs, in the order it runs them.

    Without batch_size and batch_seconds there is no batching (None: callers keep one key per call).
    A batch closes before the item that would take it past ``batch_seconds`` (an item longer than
    that stands alone) or at ``batch_size`` items. ``sort_by_length`` orders items longest first
    (stable: equal lengths keep plan order), so batches hold similar lengths and the first batch is
    the largest one: an out-of-memory error comes at once, not hours in.
    """
    order = list(range(len(lengths)))
    if sort_by_length:
        order.sort(key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    seconds = 0.0
    for i in order:
        full = (batch_size and len(current) >= batch_size) or (
            batch_seconds is not None and current and seconds + lengths[i] > batch_seconds)
        if full:
            batches.append(current)
            current, seconds = [], 0.0
        current.append(i)
        seconds += lengths[i]
    if current:
        batches.append(current)
    return batches


def padding_ratio(lengths: list[float], batches: list[list[int]]) -> float:
    """The share of padded batch length that is padding: 1 - sum(lengths) / sum(max length x batch size)."""
    padded = sum(max(lengths[i] for i in b) * len(b) for b in batches)
    return 1 - sum(lengths[i] for b in batches for i in b) / padded if padded else 0.0
