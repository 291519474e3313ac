"""A KV cache that does not copy itself every decode step.

``DynamicCache``'s layers grow by ``torch.cat``: every decode step copies each layer's whole key and
value tensors to append one column, so a step's cost grows with the batch times the context, and on
CPU that copy was about a tenth of a SmolLM2 decode step at batch 8 (bench/README.md, the engine's
profile). :class:`SlackLayer` keeps each layer's keys and values as a prefix view of a buffer
preallocated with spare columns: a step writes its column in place, and only a full buffer (or a
batch reshaped by a row joining or leaving, which replaces the tensors) allocates again, with room for
:data:`SLACK` more steps. What attention reads is the same tensor values as before, so the model
computes the same numbers.
"""

from __future__ import annotations

from typing import Any

from transformers.cache_utils import DynamicLayer

__all__ = ["SLACK", "SlackLayer", "preallocate"]

#: spare columns allocated past the current length (decode steps between two reallocations)
SLACK = 64


class SlackLayer(DynamicLayer):
    """A full-attention cache layer whose ``keys``/``values`` are views of buffers with spare room.

    Anything may still assign ``keys``/``values`` (a row leaving selects rows, a row joining pads and
    concatenates, the left trim slices): the next :meth:`update` sees that they no longer are a prefix
    of its buffers and copies them into fresh ones.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._kbuf: Any = None
        self._vbuf: Any = None

    def _owned(self) -> bool:
        """Whether ``keys``/``values`` are the prefix views of this layer's buffers."""
        k, buf = self.keys, self._kbuf
        if buf is None or k is None or k.dim() != 4 or self.values is None:
            return False
        return (
            k.data_ptr() == buf.data_ptr()
            and self.values.data_ptr() == self._vbuf.data_ptr()
            and k.shape[:2] == buf.shape[:2]
            and k.stride() == buf.stride()
        )

    def _regrow(self, extra: int) -> None:
        """Copy ``keys``/``values`` into fresh buffers with room for ``extra`` + :data:`SLACK` columns."""
        import torch

        for name in ("keys", "values"):
            cur = getattr(self, name)
            b, h, n, d = cur.shape
            buf = torch.empty((b, h, n + extra + SLACK, d), dtype=cur.dtype, device=cur.device)
            buf[:, :, :n].copy_(cur)
            setattr(self, "_kbuf" if name == "keys" else "_vbuf", buf)
            setattr(self, name, buf[:, :, :n])

    def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.keys is None or self.keys.dim() != 4 or self.keys.shape[-2] == 0:
            # the first states (a prefill): they become the buffer's prefix
            self.keys, self.values = key_states, value_states
            self._kbuf = self._vbuf = None
            self._regrow(0)
            return self.keys, self.values
        n, q = self.keys.shape[-2], key_states.shape[-2]
        if not self._owned() or n + q > self._kbuf.shape[-2]:
            self._regrow(q)
        self._kbuf[:, :, n : n + q].copy_(key_states)
        self._vbuf[:, :, n : n + q].copy_(value_states)
        self.keys, self.values = self._kbuf[:, :, : n + q], self._vbuf[:, :, : n + q]
        return self.keys, self.values


def preallocate(cache: Any) -> Any:
    """``cache`` with each plain full-attention layer (``DynamicLayer``) replaced by a :class:`SlackLayer`
    (other kinds, e.g. sliding-window layers, are kept as they are)."""
    layers = getattr(cache, "layers", None)
    if layers:
        cache.layers = [SlackLayer() if type(layer) is DynamicLayer else layer for layer in layers]
    return cache
