"""Which keys each query of a flex or flash attention call attends, and what flex adds to its scores, read from what
the call received, as functions of blocks: ``mask(rows, c, d)`` gives the permission of the query rows at positions
``rows`` against keys ``c:d``, so a statistics capture never holds a (query x key) tensor beyond one block, and a
capture that keeps weights builds its ``allowed`` from the same function (``dense``).

**Flex attention** (``FlexMask``): a ``BlockMask`` as the kernel applies it. A block of (query, key) tiles the mask
lists as full is attended whole, a partial block where ``mask_mod(b, h, q_idx, kv_idx)`` says so, and any other block
not at all. ``mask_mod`` is evaluated as flex evaluates it, under ``torch.vmap`` over index tensors, for the selected
heads. Score changes (``score_mod``) come after the softcapped logits: ``FlexScores`` for the position bias
transformers' flex function adds (a float mask it adds is read as every float mask is), ``CalledScores`` for a
``score_mod`` attnprobe cannot read, which it calls on the recomputed logits.

**Flash attention** (``FlashDocuments``): the kernel attends within documents (varlen ``cu_seqlens``, packed
``position_ids``, or the unpadded tokens of each sequence), causally aligned to the lower right of each document
(its last query sees its last key; to the upper left where transformers says the kernel does), within
``window_size``. A query or key the kernel never sees (padding unpadded away) belongs to no document.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...probe.engine.attention_math import MaskBlocks, ScoreBlocks
from ...probe.errors import UnsupportedModelError

__all__ = ["MaskBlocks", "ScoreBlocks"]

#: query rows per block when a whole ``allowed`` is built from a mask function (``dense``)
_DENSE_ROWS = 256


def dense(mask: MaskBlocks, q_len: int, k_len: int, device) -> torch.Tensor:
    """``(batch or 1, 1 or head, query, key)`` bool: the whole permission, built from blocks of rows."""
    parts = [
        mask(torch.arange(a, min(a + _DENSE_ROWS, q_len), device=device), 0, k_len)
        for a in range(0, q_len, _DENSE_ROWS)
    ]
    return torch.cat(parts, dim=2) if parts else torch.zeros(1, 1, 0, k_len, dtype=torch.bool, device=device)


def vmap_bhqk(fn: Callable, *, score: bool) -> Callable:
    """``fn`` over index tensors ``b`` (B,), ``h`` (H,), ``q`` (Q,), ``kv`` (K,) -> ``(B, H, Q, K)``, as flex calls its
    ``mask_mod`` (and, with ``score``, its ``score_mod``, whose first argument is the ``(B, H, Q, K)`` scores)."""
    prefix = (0,) if score else ()
    for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)):
        fn = torch.vmap(fn, in_dims=prefix + dims, out_dims=0)
    return _indexing_as_flex(fn)


def _indexing_as_flex(fn: Callable) -> Callable:
    """``fn`` run as flex runs its mods: with ``tensor[index]`` read as torch's index op (``TransformGetItemToIndex``).
    Without it, torch 2.6's vmap refuses a mod that indexes a tensor by its index arguments (transformers' padding
    mask, ``padding_mask[batch_idx, kv_idx]``: ".item() under vmap") that flex itself evaluates."""
    try:
        from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    except ImportError:  # a torch that moved it: vmap alone
        return fn

    def indexed(*args: torch.Tensor) -> torch.Tensor:
        with TransformGetItemToIndex():
            return fn(*args)

    return indexed


# ------------------------------------------------------------------------------------------------ flex
class FlexMask:
    """The permission of a flex call with a ``BlockMask``, for the selected heads (see the module docstring)."""

    def __init__(self, block_mask, *, batch: int, heads: tuple[int, ...], q_len: int, k_len: int) -> None:
        self.block_q, self.block_kv = (int(s) for s in block_mask.BLOCK_SIZE)
        n_kv = -(-k_len // self.block_kv)
        self.partial = _block_map(block_mask.kv_num_blocks, block_mask.kv_indices, n_kv, heads)
        full = block_mask.full_kv_num_blocks
        self.full = None if full is None else _block_map(full, block_mask.full_kv_indices, n_kv, heads)
        self.mod = vmap_bhqk(block_mask.mask_mod, score=False)
        device = block_mask.kv_num_blocks.device
        self.batch_index = torch.arange(batch, device=device)  # (batch,)
        self.heads = torch.tensor(heads, dtype=torch.long, device=device)  # (head,)
        self.shape = (batch, len(heads), q_len, k_len)

    def __call__(self, rows: torch.Tensor, c: int, d: int) -> torch.Tensor:
        keys = torch.arange(c, d, device=rows.device)  # (key,)
        allowed = self.mod(self.batch_index, self.heads, rows, keys).bool()  # (batch, head, rows, key), maybe a view
        q_blocks, kv_blocks = rows // self.block_q, keys // self.block_kv  # (rows,), (key,)
        allowed = allowed & _tiles(self.partial, q_blocks, kv_blocks)
        if self.full is not None:
            allowed = allowed | _tiles(self.full, q_blocks, kv_blocks)
        return allowed


def _block_map(num_blocks: torch.Tensor, indices: torch.Tensor, n_kv: int, heads: tuple[int, ...]) -> torch.Tensor:
    """``(batch or 1, 1 or head, query blocks, key blocks)`` bool: the blocks a BlockMask lists for each query block."""
    listed = torch.arange(indices.shape[-1], device=indices.device) < num_blocks[..., None]  # (b, h, q blocks, slots)
    columns = torch.where(listed, indices.long(), n_kv)  # the slots not used point one past the last key block
    blocks = torch.zeros(*indices.shape[:-1], n_kv + 1, dtype=torch.bool, device=indices.device)
    blocks.scatter_(-1, columns, True)
    blocks = blocks[..., :n_kv]  # (batch or 1, head or 1, query blocks, key blocks)
    if blocks.shape[1] > 1:
        blocks = blocks.index_select(1, torch.tensor(heads, dtype=torch.long, device=blocks.device))
    return blocks


def _tiles(blocks: torch.Tensor, q_blocks: torch.Tensor, kv_blocks: torch.Tensor) -> torch.Tensor:
    """The block map at each (row, key) of a block: ``(batch or 1, 1 or head, rows, key)``."""
    return blocks[:, :, q_blocks][..., kv_blocks]


@dataclass(frozen=True)
class FlexScores:
    """The position bias transformers' flex function adds to the softcapped logits (``(batch or 1, head or 1, query,
    key)``, of the selected heads)."""

    bias: torch.Tensor

    def __call__(self, s: torch.Tensor, rows: torch.Tensor, c: int, d: int) -> torch.Tensor:
        return s + self.bias[:, :, rows.to(self.bias.device), c:d].to(s.dtype)  # (batch, head, rows, key)


class CalledScores:
    """A ``score_mod`` attnprobe cannot read, applied by calling it (under ``torch.vmap``, as flex does) on the
    recomputed logits of the selected heads."""

    def __init__(self, score_mod: Callable, *, batch: int, heads: tuple[int, ...], device) -> None:
        self.mod = vmap_bhqk(score_mod, score=True)
        self.batch_index = torch.arange(batch, device=device)
        self.heads = torch.tensor(heads, dtype=torch.long, device=device)

    def __call__(self, s: torch.Tensor, rows: torch.Tensor, c: int, d: int) -> torch.Tensor:
        keys = torch.arange(c, d, device=s.device)
        return self.mod(s, self.batch_index, self.heads, rows.to(s.device), keys).to(s.dtype)


# ------------------------------------------------------------------------------------------------ flash
@dataclass(frozen=True)
class FlashDocuments:
    """Which query attends which key in one flash call.

    ``q_doc`` ``(batch, query)`` / ``k_doc`` ``(batch, key)``: the document of each query and key (-1: the kernel never
    sees it); ``q_pos`` / ``k_pos``: their positions in the document, a query's shifted by its document's keys less
    its queries (the kernel's lower-right alignment). A query attends a key of its document at or before its
    position (``causal``), at most ``window[0]`` before and (not causal) ``window[1]`` after it.
    """

    q_doc: torch.Tensor
    q_pos: torch.Tensor
    k_doc: torch.Tensor
    k_pos: torch.Tensor
    causal: bool
    window: tuple[int, int] | None

    def __call__(self, rows: torch.Tensor, c: int, d: int) -> torch.Tensor:
        rows = rows.to(self.q_doc.device)
        qd, qp = self.q_doc[:, rows, None], self.q_pos[:, rows, None]  # (batch, rows, 1)
        kd, kp = self.k_doc[:, None, c:d], self.k_pos[:, None, c:d]  # (batch, 1, key)
        allowed = (qd == kd) & (qd >= 0)  # (batch, rows, key)
        if self.causal:
            allowed &= kp <= qp
        if self.window is not None:
            left, right = self.window
            allowed &= kp >= qp - left
            if not self.causal:
                allowed &= kp <= qp + right
        return allowed[:, None]  # (batch, 1, rows, key)


@dataclass(frozen=True)
class FlashCall:
    """What decides a flash call's documents: the 2-D padding mask, the varlen arguments, the position ids."""

    batch: int
    q_len: int
    k_len: int
    padding: torch.Tensor | None  # (batch, positions) 1 = token, as transformers hands it to the flash function
    position_ids: torch.Tensor | None  # (batch or 1, query)
    cu_q: torch.Tensor | None  # (documents + 1,) int
    cu_k: torch.Tensor | None
    causal: bool
    sliding_window: int | None
    top_left: bool
    device: torch.device


def flash_documents(call: FlashCall) -> FlashDocuments:
    """The documents of a flash call, as ``_flash_attention_forward`` forms them (hooks/hf/compat.py, item 9)."""
    causal = call.causal and not (call.top_left and call.q_len == 1)
    window = None
    if call.sliding_window is not None and call.k_len > call.sliding_window:
        window = (call.sliding_window - 1, call.sliding_window - 1)
    if call.padding is not None:
        parts = _unpadded(call)
    elif call.cu_q is not None and call.cu_k is not None:
        parts = _varlen(call, call.cu_q, call.cu_k)
    elif _packed(call.position_ids, call.batch):
        assert call.position_ids is not None
        flat = call.position_ids.reshape(-1)
        starts = (flat == flat.min()).nonzero().view(-1)  # each document restarts at the smallest position
        cu = torch.cat([starts, torch.tensor([flat.numel()], device=flat.device)])
        parts = _varlen(call, cu, cu)
    else:
        parts = _plain(call)
    q_doc, q_index, k_doc, k_index, shift = parts
    q_pos = q_index if call.top_left else q_index + shift  # (batch, query)
    return FlashDocuments(q_doc, q_pos, k_doc, k_index, causal, window)


def _packed(position_ids: torch.Tensor | None, batch: int) -> bool:
    """transformers' ``_is_packed_sequence``: one row whose positions are not one increasing run."""
    if position_ids is None or batch != 1 or position_ids.shape[-1] == 1:
        return False
    run = torch.arange(position_ids.shape[-1], device=position_ids.device) + position_ids.min()
    return bool((run - position_ids).abs().sum())


def _plain(call: FlashCall):
    device = call.device
    rows = torch.arange(call.batch, device=device)[:, None]  # (batch, 1): one document per sequence
    q_index = torch.arange(call.q_len, device=device).expand(call.batch, -1)  # (batch, query)
    k_index = torch.arange(call.k_len, device=device).expand(call.batch, -1)  # (batch, key)
    shift = call.k_len - call.q_len
    return rows.expand(-1, call.q_len), q_index, rows.expand(-1, call.k_len), k_index, shift


def _unpadded(call: FlashCall):
    """Padding: each sequence's tokens, unpadded, are one document (the queries: the last ``q_len`` positions of the
    mask; one query per sequence when ``q_len`` is 1)."""
    assert call.padding is not None
    keys = call.padding[:, : call.k_len].bool()  # keys past the mask (a static cache's slots) are cut off
    if keys.shape[1] < call.k_len:
        keys = torch.nn.functional.pad(keys, (0, call.k_len - keys.shape[1]), value=False)
    if call.q_len == min(call.k_len, call.padding.shape[1]):
        queries = keys[:, : call.q_len]
    elif call.q_len == 1:
        queries = torch.ones(call.batch, 1, dtype=torch.bool, device=keys.device)
    else:
        queries = call.padding[:, -call.q_len :].bool()
    rows = torch.arange(call.batch, device=keys.device)[:, None]  # (batch, 1)
    k_doc, q_doc = torch.where(keys, rows, -1), torch.where(queries, rows, -1)  # (batch, key), (batch, query)
    k_index, q_index = keys.long().cumsum(1) - 1, queries.long().cumsum(1) - 1
    shift = (keys.sum(1) - queries.sum(1))[:, None]  # (batch, 1): each document's keys less its queries
    return q_doc, q_index, k_doc, k_index, shift


def _varlen(call: FlashCall, cu_q: torch.Tensor, cu_k: torch.Tensor):
    """Documents given by cumulative lengths over the flattened (batch x position) tokens, as the kernel reads them."""
    q_doc, q_index, q_lens = _documents(cu_q, call.batch * call.q_len)
    k_doc, k_index, k_lens = _documents(cu_k, call.batch * call.k_len)
    shift = torch.where(q_doc >= 0, (k_lens - q_lens)[q_doc.clamp(min=0)], 0)  # (batch * query,)
    q_doc, q_index, shift = (t.view(call.batch, call.q_len) for t in (q_doc, q_index, shift))
    k_doc, k_index = k_doc.view(call.batch, call.k_len), k_index.view(call.batch, call.k_len)
    if call.batch > 1:
        _one_row_each(q_doc, k_doc)
    return q_doc, q_index, k_doc, k_index, shift


def _documents(cu: torch.Tensor, tokens: int):
    """``(doc, index, lengths)``: each flattened token's document (-1 past the last) and place in it."""
    cu = cu.long().to(cu.device)
    flat = torch.arange(tokens, device=cu.device)
    doc = torch.bucketize(flat, cu[1:], right=True)  # (tokens,): the boundaries at or before each token
    inside = flat < cu[-1]
    doc = torch.where(inside, doc, -1)
    index = torch.where(inside, flat - cu[doc.clamp(min=0)], 0)
    return doc, index, cu.diff()


def _one_row_each(q_doc: torch.Tensor, k_doc: torch.Tensor) -> None:
    """A record holds (batch, query, key): a document whose queries and keys are not all in one row of the batch
    cannot be drawn so."""
    n = int(max(q_doc.max(), k_doc.max())) + 1
    rows_of = [_rows_of(doc, n) for doc in (q_doc, k_doc)]
    (q_low, q_high), (k_low, k_high) = rows_of
    both = (q_high >= 0) & (k_high >= 0)
    if bool(((q_low != q_high) | (k_low != k_high))[q_high.ge(0) | k_high.ge(0)].any()) or bool(
        (q_low != k_low)[both].any()
    ):
        raise UnsupportedModelError(
            f"a flash attention call's cu_seq_lens put one document's tokens in two rows of a batch of "
            f"{q_doc.shape[0]}: attnprobe records (batch, query, key) and cannot show attention across rows. Pass "
            "packed sequences as one row (batch 1), as padding-free collators do"
        )


def _rows_of(doc: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lowest, highest)`` row holding each of ``n`` documents (``batch`` and -1 where none)."""
    rows = torch.arange(doc.shape[0], device=doc.device)[:, None].expand_as(doc)
    seen = doc >= 0
    low = torch.full((n,), doc.shape[0], device=doc.device).scatter_reduce(0, doc[seen], rows[seen], "amin")
    high = torch.full((n,), -1, device=doc.device).scatter_reduce(0, doc[seen], rows[seen], "amax")
    return low, high
