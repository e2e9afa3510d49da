"""The running batch of the embedded engine: a left-padded KV cache plus per-row decode state.

Layout: every row's tokens end at the same column, so one decode step writes one column for all
rows and a Hugging Face model needs no per-row cache index; shorter rows carry padding on the left,
masked by the 2-D attention mask, and positions are per row (`next_pos`). Rows join by merging two
batches (the shorter one is left-padded) and leave by selecting the rows to keep, after which
columns that are padding in every remaining row are cut off.

Why not `transformers.DynamicCache` as is: its layers `torch.cat` the whole cache at every step,
which grows quadratically with length. `SlabLayer` keeps each layer in a preallocated buffer that
doubles when full, so a decode step writes one column in place. It is a `DynamicLayer` subclass
(transformers 5.23 is pinned) that overrides storage only; the model sees views of the filled part.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

_HEADROOM = 64  # spare columns allocated with a batch, so the first decode steps never reallocate


class SlabLayer(DynamicLayer):
    """One layer's keys and values in a [batch, kv_heads, capacity, head_dim] buffer, filled to `length`."""

    def __init__(self) -> None:
        super().__init__()
        self.length = 0
        self.k_buf: torch.Tensor | None = None
        self.v_buf: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, q = self.length, key_states.shape[-2]
        if self.k_buf is None or n + q > self.k_buf.shape[-2]:
            self._reserve(max(n + q + _HEADROOM, 2 * (n + q)), key_states, value_states)
        assert self.k_buf is not None and self.v_buf is not None
        self.k_buf[:, :, n : n + q] = key_states
        self.v_buf[:, :, n : n + q] = value_states
        self.set(self.k_buf, self.v_buf, n + q)
        return self.keys, self.values

    def _reserve(self, capacity: int, like_k: torch.Tensor, like_v: torch.Tensor) -> None:
        b, h, _, d = like_k.shape
        k = like_k.new_zeros((b, h, capacity, d))
        v = like_v.new_zeros((b, h, capacity, like_v.shape[-1]))
        if self.k_buf is not None and self.v_buf is not None and self.length:
            k[:, :, : self.length] = self.k_buf[:, :, : self.length]
            v[:, :, : self.length] = self.v_buf[:, :, : self.length]
        self.k_buf, self.v_buf = k, v

    def set(self, k_buf: torch.Tensor, v_buf: torch.Tensor, length: int) -> None:
        """Adopt buffers whose first `length` columns are filled."""
        self.k_buf, self.v_buf, self.length = k_buf, v_buf, length
        self.keys, self.values = k_buf[:, :, :length], v_buf[:, :, :length]
        if not self.is_initialized:
            self.lazy_initialization(k_buf, v_buf)

    def get_seq_length(self) -> int:
        return self.length

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        assert self.k_buf is not None and self.v_buf is not None
        self.set(self.k_buf[indices], self.v_buf[indices], self.length)


def new_cache(num_layers: int) -> Cache:
    return Cache(layers=[SlabLayer() for _ in range(num_layers)])


def _layers(cache: Cache) -> list[SlabLayer]:
    return cache.layers  # type: ignore[return-value]


class Batch:
    """Rows being decoded together. Row i holds `rows[i]` (None once finished, until compaction).

    `last_tok[i]` is the newest sampled token of row i, not yet in the cache; `next_pos[i]` is its
    position. `mask` covers the cache columns plus room for the next one.
    """

    def __init__(
        self,
        cache: Cache,
        mask: torch.Tensor,
        rows: list[object | None],
        last_tok: torch.Tensor,
        next_pos: torch.Tensor,
        params: torch.Tensor,
    ) -> None:
        self.cache, self.rows = cache, rows
        self.mask = mask  # (B, capacity) int64; columns [0, length) are valid
        self.last_tok, self.next_pos = last_tok, next_pos  # (B,) int64
        self.params = params  # (B, 3) float32: temperature, top_p, top_k per row
        self.has_pad = not bool(self.mask[:, : self.length].all())

    @property
    def size(self) -> int:
        return len(self.rows)

    @property
    def length(self) -> int:
        return _layers(self.cache)[0].length

    @property
    def dead(self) -> int:
        return sum(r is None for r in self.rows)

    def step_mask(self) -> torch.Tensor | None:
        """Attention mask for the next decode step (None when no row has padding: the causal fast path)."""
        n = self.length
        if n + 1 > self.mask.shape[1]:
            grown = self.mask.new_zeros((self.size, max(2 * (n + 1), n + _HEADROOM)))
            grown[:, :n] = self.mask[:, :n]
            self.mask = grown
        self.mask[:, n] = 1
        return self.mask[:, : n + 1] if self.has_pad else None

    def drop_finished(self) -> None:
        """Keep only unfinished rows and cut columns that are padding in all of them."""
        idx, cut = self.live()
        self.cache.batch_select_indices(idx)
        self.mask = self.mask[idx]
        self.rows = [self.rows[i] for i in idx.tolist()]
        self.last_tok, self.next_pos, self.params = self.last_tok[idx], self.next_pos[idx], self.params[idx]
        if cut:
            n = self.length
            for layer in _layers(self.cache):
                assert layer.k_buf is not None and layer.v_buf is not None
                layer.set(layer.k_buf[:, :, cut:], layer.v_buf[:, :, cut:], n - cut)
            self.mask = self.mask[:, cut:]
        self.has_pad = not bool(self.mask[:, : self.length].all())

    def live(self) -> tuple[torch.Tensor, int]:
        """Indices of unfinished rows, and the first column any of them uses (columns before it are
        padding in every live row)."""
        idx = torch.tensor([i for i, r in enumerate(self.rows) if r is not None], dtype=torch.long)
        used = self.mask[idx, : self.length].any(dim=0).nonzero()
        return idx, int(used[0]) if used.numel() else self.length

    def merge(self, other: Batch) -> None:
        """Append `other`'s rows, dropping finished rows of both; the part with fewer columns is
        left-padded to the longer one. One copy of each part's cache."""
        (idx_a, start_a), (idx_b, start_b) = self.live(), other.live()
        w_a, w_b = self.length - start_a, other.length - start_b
        n, b_a, b_b = max(w_a, w_b), len(idx_a), len(idx_b)
        cap = n + _HEADROOM
        for la, lb in zip(_layers(self.cache), _layers(other.cache), strict=True):
            bufs = []
            for buf_a, buf_b in ((la.k_buf, lb.k_buf), (la.v_buf, lb.v_buf)):
                assert buf_a is not None and buf_b is not None
                out = buf_a.new_zeros((b_a + b_b, buf_a.shape[1], cap, buf_a.shape[3]))
                out[:b_a, :, n - w_a : n] = buf_a[idx_a, :, start_a : start_a + w_a]
                out[b_a:, :, n - w_b : n] = buf_b[idx_b, :, start_b : start_b + w_b]
                bufs.append(out)
            la.set(bufs[0], bufs[1], n)
        mask = self.mask.new_zeros((b_a + b_b, cap))
        mask[:b_a, n - w_a : n] = self.mask[idx_a, start_a : start_a + w_a]
        mask[b_a:, n - w_b : n] = other.mask[idx_b, start_b : start_b + w_b]
        self.mask = mask
        self.rows = [self.rows[i] for i in idx_a.tolist()] + [other.rows[i] for i in idx_b.tolist()]
        self.last_tok = torch.cat([self.last_tok[idx_a], other.last_tok[idx_b]])
        self.next_pos = torch.cat([self.next_pos[idx_a], other.next_pos[idx_b]])
        self.params = torch.cat([self.params[idx_a], other.params[idx_b]])
        self.has_pad = not bool(self.mask[:, :n].all())
