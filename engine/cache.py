"""Static KV cache: preallocated per layer, written at explicit positions.

Slot index == token position, so a query at position `q` may attend exactly the slots `<= q`:
the visibility mask is derived from positions alone. Ragged batches (rows at different lengths)
need nothing more, and rejecting tokens is just not advancing a row's length: stale slots past
the length are never visible and get overwritten by the next tokens written there.
"""

from __future__ import annotations

from typing import Union

import torch

from engine import triton_kernels

# Cache rows of a batch: None (rows 0..B-1), a slice of consecutive rows (views, no copy) or a (B,) index tensor.
Rows = Union[torch.Tensor, slice, None]


def to_device(data, device: torch.device | str, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Host numbers (a list, nested lists) as a tensor on `device`, the host not stopped: on CUDA through pinned
    memory and a queued copy. `torch.tensor(data, device=...)` copies from pageable memory, and that copy waits
    for everything the stream has queued; the host then launches the next work into an idle GPU."""
    if torch.device(device).type != "cuda":
        return torch.tensor(data, dtype=dtype, device=device)
    if torch.cuda.is_current_stream_capturing():  # a captured copy would replay from this one host buffer
        raise RuntimeError("to_device inside a CUDA graph capture: give the graph its numbers as an input tensor")
    return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def row_index(slots: list[int], device: torch.device) -> Rows:
    """Cache rows for these slots: a slice when they are consecutive (views, no gather), else an index tensor."""
    if slots == list(range(slots[0], slots[0] + len(slots))):
        return slice(slots[0], slots[0] + len(slots))
    return to_device(slots, device)


class KVCache:
    """Keys/values for `num_layers` layers of `batch_size` rows, `max_seq_len` positions each.

    k[layer], v[layer]: (B, H_kv, S_max, D) in the model dtype.
    lengths: (B,) int64, the number of committed tokens per row (bookkeeping; masks use positions).
    """

    # Row r's first kv_len slots are what `read` returns for it: an attention kernel may read them in place.
    reads_in_place = True
    # Slot index == position: a query sees no slot past its own position (an attention kernel may stop there).
    slot_is_position = True

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (batch_size, num_kv_heads, max_seq_len, head_dim)
        # One tensor for every layer's K and V (`move` touches all layers in two kernels); k[layer] and
        # v[layer] are contiguous views of it.
        self.storage = torch.zeros((2, num_layers, *shape), dtype=dtype, device=device)
        # (Indexed one by one: unbind's views may not be written in place while autograd records.)
        self.k = [self.storage[0, i] for i in range(num_layers)]
        self.v = [self.storage[1, i] for i in range(num_layers)]
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self.num_layers = num_layers

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token of one row costs across all layers (K and V)."""
        if not self.k:
            return 0
        _, heads, _, dim = self.k[0].shape
        return 2 * self.num_layers * heads * dim * self.k[0].element_size()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def write(self, layer: int, rows: Rows, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v (B, H_kv, T, D) at positions input_pos (B, T) of cache rows `rows`.

        rows: None (rows 0..B-1), a slice of consecutive rows (a view, no copy) or a (B,) index tensor.
        """
        k_cache, v_cache = self.k[layer], self.v[layer]
        if k_cache.is_cuda and triton_kernels.kv_write(k_cache, v_cache, rows, input_pos, k, v):
            return  # one kernel for both (the indexing below is 5-6 kernels a layer)
        if rows is None:
            rows = slice(0, k.shape[0])
        if isinstance(rows, slice):
            k_cache, v_cache = k_cache[rows], v_cache[rows]
            rows = torch.arange(k.shape[0], device=k.device)
        # Advanced indices separated by a slice put their dims first: target is (B, T, H_kv, D).
        k_cache[rows[:, None], :, input_pos] = k.transpose(1, 2)
        v_cache[rows[:, None], :, input_pos] = v.transpose(1, 2)

    def read(self, layer: int, rows: Rows, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values (B, H_kv, kv_len, D) of the first kv_len slots of `rows` (a view unless rows is a tensor)."""
        k, v = self.k[layer], self.v[layer]
        if rows is None:
            return k[:, :, :kv_len], v[:, :, :kv_len]
        if isinstance(rows, torch.Tensor) and 2 * kv_len >= self.max_seq_len:
            # Most of each row is read anyway: index_select copies whole rows at memory speed, where the
            # advanced-index gather of a narrowed view runs several times slower (on an H200, batch 256,
            # 512 of 560 slots: 31 us against 123 us a tensor, most of a decode step's time).
            return k.index_select(0, rows)[:, :, :kv_len], v.index_select(0, rows)[:, :, :kv_len]
        return k[rows, :, :kv_len], v[rows, :, :kv_len]

    def visibility(self, input_pos: torch.Tensor, rows: torch.Tensor | None, kv_len: int) -> torch.Tensor:
        """(B, 1, T, kv_len) bool mask for a pass writing at input_pos (B, T): slot == position."""
        return visibility_mask(input_pos, kv_len)

    def move(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K and V at slots src (B, n) of cache rows `rows` (B,) to slots dst (B, n) of the same
        rows (all read before any is written: the two may overlap). A draft tree's accepted branch moves to
        consecutive positions this way (`engine.tree`)."""
        r = rows[:, None]
        # Advanced indices split by a slice put their dims first: (B, n, 2, layers, H_kv, D).
        self.storage[:, :, r, :, dst] = self.storage[:, :, r, :, src]

    def rollback(self, rows: torch.Tensor, lengths: torch.Tensor) -> None:
        """Set rows' committed lengths back (or forward); nothing is erased."""
        self.lengths[rows] = lengths

    def reset(self, rows: torch.Tensor | None = None) -> None:
        if rows is None:
            self.lengths.zero_()
        else:
            self.lengths[rows] = 0


def visibility_mask(input_pos: torch.Tensor, kv_len: int) -> torch.Tensor:
    """(B, 1, T, kv_len) bool: slot s is visible to the query at position input_pos[b, t] iff s <= that position."""
    slots = torch.arange(kv_len, device=input_pos.device)
    return (slots[None, None, None, :] <= input_pos[:, None, :, None])


class WindowedKVCache(KVCache):
    """A ring buffer holding only the last `window` positions per row (block-level eviction).

    Position `p` lives in slot `p % ring`; `slot_pos` records which position each slot holds, so the
    mask can show a query at `q` exactly the positions in (q - window, q]. `slack` slots beyond the
    window absorb the speculative writes of one round (positions past the committed length), so
    they never evict a position a later query still needs.
    """

    reads_in_place = False  # `read` returns the whole ring, whatever kv_len
    slot_is_position = False  # slot p % ring

    def __init__(self, num_layers, batch_size, num_kv_heads, window, head_dim, slack, dtype=torch.float32, device="cpu"):
        super().__init__(num_layers, batch_size, num_kv_heads, window + slack, head_dim, dtype, device)
        self.window = window
        self.slot_pos = torch.full((batch_size, window + slack), -1, dtype=torch.long, device=device)

    def write(self, layer, rows, input_pos, k, v):
        super().write(layer, rows, input_pos % self.max_seq_len, k, v)

    def read(self, layer, rows, kv_len):
        return super().read(layer, rows, self.max_seq_len)

    def visibility(self, input_pos, rows, kv_len):
        if rows is None:
            rows = slice(0, input_pos.shape[0])
        if isinstance(rows, slice):
            rows = torch.arange(rows.start, rows.stop, device=input_pos.device)
        # The pass about to run writes these positions in every layer: record them first.
        self.slot_pos[rows[:, None], input_pos % self.max_seq_len] = input_pos
        held = self.slot_pos[rows][:, None, None, :]  # (B, 1, 1, ring)
        query = input_pos[:, None, :, None]  # (B, 1, T, 1)
        return (held >= 0) & (held <= query) & (held > query - self.window)

    def reset(self, rows=None):
        super().reset(rows)
        if rows is None:
            self.slot_pos.fill_(-1)
        else:
            self.slot_pos[rows] = -1
