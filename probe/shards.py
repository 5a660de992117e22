"""Sharded models: where a process sits among the processes that run one model, and records with global labels.

A model loaded with tensor parallelism (``tp``) runs each attention module on a slice of its heads in every process
of a tensor-parallel group; pipeline parallelism (``pp``) runs a slice of its layers on every stage; data-parallel
dimensions (``dp``, ``fsdp``, ``dp_replicate``, ``dp_shard``, ...) hold whole copies of the computation, fed
different inputs. ``ShardLayout`` reads this from the model's ``torch.distributed.DeviceMesh`` (named dimensions);
the functions below turn what one process sees into what the model is:

- ``HeadShard.resolve``: the global numbers of this process's heads, from an all-gather of every process's local head
  count over the tensor-parallel group (uneven splits included), checked against the model's declared head count;
- ``global_layer_order``: the attention modules of every pipeline stage, in the model's module order (identity layers
  stand in for the layers a stage does not hold, and keep their place in the module tree), so layer numbers are the
  model's on every stage;
- ``join_records`` / ``join``: whole records from the shards of one call (heads concatenated in head order, the
  layers of every stage side by side), as ``capture(..., gather=True)`` gives them and as saved per-rank captures
  combine offline.

Nothing here runs inside a forward but ``HeadShard.resolve`` (once per attention module and process: cached), which
the capture session calls on the first call of a module it records.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from .errors import AttnprobeError
from .record import AttentionRecord

#: Mesh dimensions that split the model (the processes along them run one copy of the computation on one input).
MODEL_DIMS = ("pp", "tp")
#: Mesh dimensions that hold whole copies of the computation, fed different inputs.
DATA_DIMS = ("dp", "ddp", "fsdp", "hsdp", "dp_replicate", "dp_shard", "dp_shard_cp", "replicate", "shard")
#: ``record.meta`` keys that say which process made a record (``join_records`` folds them into ``ranks``).
RANK_KEYS = ("rank", "tp_rank", "pp_rank", "dp_rank")


class ShardLayoutError(AttnprobeError, ValueError):
    """A sharded model's layout attnprobe cannot label right (or a join of shards that do not fit together).

    ``dims``: the mesh's dimension sizes, when known."""

    def __init__(self, message: str, *, dims: Mapping[str, int] | None = None) -> None:
        super().__init__(message)
        self.dims = dict(dims or {})


# ----------------------------------------------------------------------------------------------- the layout


@dataclass(frozen=True, eq=False)
class ShardLayout:
    """Where this process sits in the mesh of processes that run one model.

    Example (one process, no mesh: every size is 1)::

        >>> layout = ShardLayout.single()
        >>> layout.tp_size, layout.pp_size, layout.dp_size, layout.sharded
        (1, 1, 1, False)
    """

    rank: int
    """This process's global rank."""
    world: int
    """How many processes the mesh holds."""
    sizes: Mapping[str, int]
    """Size of every named mesh dimension, in mesh order (e.g. ``{"pp": 1, "fsdp": 1, "tp": 2}``)."""
    coords: Mapping[str, int]
    """This process's coordinate along every dimension."""
    mesh: Any = field(default=None, repr=False)
    """The ``torch.distributed.DeviceMesh`` (None for ``single()``)."""

    @classmethod
    def single(cls) -> ShardLayout:
        return cls(rank=0, world=1, sizes={}, coords={})

    @classmethod
    def from_mesh(cls, mesh) -> ShardLayout:
        """The layout of this process in ``mesh``, a ``DeviceMesh`` with named dimensions."""
        names = getattr(mesh, "mesh_dim_names", None)
        if not names:
            raise ShardLayoutError(
                "the model's device mesh has unnamed dimensions: attnprobe cannot tell tensor-parallel from "
                "data-parallel processes; name them (init_device_mesh(..., mesh_dim_names=('dp', 'tp')))"
            )
        sizes = {name: int(size) for name, size in zip(names, mesh.shape)}
        coords = {name: int(c) for name, c in zip(names, mesh.get_coordinate() or [0] * len(names))}
        unknown = [n for n, s in sizes.items() if s > 1 and n not in MODEL_DIMS + DATA_DIMS]
        if unknown:
            raise ShardLayoutError(
                f"the model's device mesh splits along {unknown} (sizes {sizes}): attnprobe labels tensor-parallel "
                f"({MODEL_DIMS[1]!r}), pipeline ({MODEL_DIMS[0]!r}) and data-parallel ({', '.join(DATA_DIMS)}) "
                "dimensions only; capture the model without that split",
                dims=sizes,
            )
        import torch.distributed as dist

        return cls(rank=dist.get_rank(), world=int(mesh.size()), sizes=sizes, coords=coords, mesh=mesh)

    # -- sizes and coordinates ------------------------------------------------------------------
    def _size(self, names) -> int:
        out = 1
        for n in names:
            out *= self.sizes.get(n, 1)
        return out

    def _index(self, names) -> int:
        """This process's index along ``names`` taken together (the first name varies slowest)."""
        index = 0
        for n in names:
            index = index * self.sizes.get(n, 1) + self.coords.get(n, 0)
        return index

    @property
    def tp_size(self) -> int:
        return self.sizes.get("tp", 1)

    @property
    def tp_rank(self) -> int:
        return self.coords.get("tp", 0)

    @property
    def pp_size(self) -> int:
        return self.sizes.get("pp", 1)

    @property
    def pp_rank(self) -> int:
        return self.coords.get("pp", 0)

    @property
    def data_dims(self) -> tuple[str, ...]:
        return tuple(n for n in self.sizes if n not in MODEL_DIMS)

    @property
    def dp_size(self) -> int:
        """Processes fed different inputs (the product of the data-parallel dimensions)."""
        return self._size(self.data_dims)

    @property
    def dp_rank(self) -> int:
        """Which share of the inputs this process takes (0 to ``dp_size - 1``)."""
        return self._index(self.data_dims)

    @property
    def shard_rank(self) -> int:
        """This process's index among the processes that share its inputs (pipeline stage, then tensor rank)."""
        return self._index(MODEL_DIMS)

    @property
    def shard_size(self) -> int:
        return self._size(MODEL_DIMS)

    @property
    def sharded(self) -> bool:
        """Whether heads or layers are split across processes (tensor or pipeline parallelism)."""
        return self.shard_size > 1

    def group(self, dim: str):
        """The process group along mesh dimension ``dim``."""
        return self.mesh.get_group(dim)

    def shard_groups(self) -> tuple[list[list[int]], int]:
        """The global ranks of every group of processes that share their inputs (one group per data-parallel
        index, model dimensions varying), and the index of this process's group."""
        names = list(self.sizes)
        ranks = self.mesh.mesh.permute(
            *[names.index(n) for n in self.data_dims], *[names.index(n) for n in names if n in MODEL_DIMS]
        )
        groups = ranks.reshape(self.dp_size, self.shard_size).tolist()
        return groups, self.dp_rank

    def describe(self) -> dict[str, Any]:
        """A JSON-able description (``Capture.info["layout"]``, a scan's metadata)."""
        return {
            "rank": self.rank,
            "world": self.world,
            "sizes": dict(self.sizes),
            "coords": dict(self.coords),
        }

    def rank_meta(self) -> dict[str, int]:
        """What ``record.meta`` says about the process that made a record."""
        meta = {"rank": self.rank}
        if self.tp_size > 1:
            meta["tp_rank"] = self.tp_rank
        if self.pp_size > 1:
            meta["pp_rank"] = self.pp_rank
        if self.dp_size > 1:
            meta["dp_rank"] = self.dp_rank
        return meta


def all_gather(value, group=None) -> list:
    """``value`` of every process of ``group``, in group-rank order (``torch.distributed.all_gather_object``)."""
    import torch.distributed as dist

    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


# ----------------------------------------------------------------------------------------------- heads (tp)


@dataclass(frozen=True)
class HeadShard:
    """Which of a module's heads this process holds: local head ``i`` is model head ``offset + i``."""

    offset: int
    kv_offset: int
    local_heads: int
    local_kv_heads: int
    num_heads: int
    """The module's query heads, over every process."""
    num_kv_heads: int

    @classmethod
    def from_counts(
        cls, counts: Sequence[tuple[int, int]], rank: int, declared: tuple[int | None, int | None], where: str = ""
    ) -> HeadShard:
        """Process ``rank``'s shard from every process's local ``(heads, kv_heads)`` (``counts``, in group-rank
        order: an all-gather over the tensor-parallel group) and the module's ``declared`` head counts (its config;
        None when unknown). Refuses counts that do not add up to the declared ones, and splits that do not keep
        each query head with its key/value head.

        Example (6 heads, 3 key/value heads over 2 processes, unevenly)::

            >>> HeadShard.from_counts([(4, 2), (2, 1)], 1, (6, 3))
            HeadShard(offset=4, kv_offset=2, local_heads=2, local_kv_heads=1, num_heads=6, num_kv_heads=3)
        """
        counts = [(int(c[0]), int(c[1])) for c in counts]
        heads = _split([c[0] for c in counts], declared[0], "query heads", where, counts)
        kv = _split([c[1] for c in counts], declared[1], "key/value heads", where, counts)
        local = counts[rank]
        shard = cls(
            offset=heads[0][rank],
            kv_offset=kv[0][rank],
            local_heads=local[0],
            local_kv_heads=local[1],
            num_heads=heads[1],
            num_kv_heads=kv[1],
        )
        shard.check(where)
        return shard

    def check(self, where: str = "") -> None:
        """Each local query head must read a local key/value head, as in the whole model."""
        group = self.num_heads // max(self.num_kv_heads, 1)
        local_group = self.local_heads // max(self.local_kv_heads, 1)
        if self.num_heads % max(self.num_kv_heads, 1) or group != local_group or self.offset // group != self.kv_offset:
            raise ShardLayoutError(
                f"{where}: this process holds query heads {self.offset}..{self.offset + self.local_heads - 1} and "
                f"key/value heads {self.kv_offset}..{self.kv_offset + self.local_kv_heads - 1} of "
                f"{self.num_heads}/{self.num_kv_heads}: a split that separates query heads from their key/value heads "
                "cannot be labelled; shard the model so that every process holds whole key/value groups"
            )

    def globals(self, local: Sequence[int], kv: bool = False) -> tuple[int, ...]:
        """Model head numbers of local heads ``local``."""
        offset = self.kv_offset if kv else self.offset
        return tuple(offset + h for h in local)

    def locals(self, heads: Sequence[int]) -> tuple[int, ...]:
        """The local positions of the model heads ``heads`` this process holds (the others left out)."""
        return tuple(h - self.offset for h in heads if self.offset <= h < self.offset + self.local_heads)


def _split(counts: list[int], declared: int | None, what: str, where: str, all_counts) -> tuple[list[int], int]:
    """(offset of every process, global count) from every process's local count."""
    total = sum(counts)
    if declared is not None and all(c == declared for c in counts) and total != declared:
        return [0] * len(counts), declared  # not split: every process holds every head
    if declared is not None and total != declared:
        raise ShardLayoutError(
            f"{where}: the tensor-parallel processes hold {counts} {what}, which add up to {total}, not the "
            f"{declared} the model declares (every process's (heads, key/value heads): {all_counts}); attnprobe "
            "labels heads split across processes or held whole by each, nothing in between"
        )
    offsets, running = [], 0
    for c in counts:
        offsets.append(running)
        running += c
    return offsets, total


# ----------------------------------------------------------------------------------------------- layers (pp)


def module_paths(model: nn.Module) -> dict[int, tuple[int, ...]]:
    """id(module) -> its place in the module tree (the child position at every level from the root). A pipeline
    stage replaces the layers it does not hold by identity modules in the same place, so places compare across
    stages where names would need parsing."""
    paths: dict[int, tuple[int, ...]] = {id(model): ()}
    todo = [model]
    while todo:
        parent = todo.pop()
        for i, child in enumerate(parent.children()):
            if id(child) not in paths:
                paths[id(child)] = (*paths[id(parent)], i)
                todo.append(child)
    return paths


@dataclass(frozen=True)
class GlobalSite:
    """One attention module of the whole model (held by this stage or another)."""

    path: tuple[int, ...]
    name: str
    num_heads: int | None
    num_kv_heads: int | None


_ORDERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {local names: global sites}


def global_layer_order(model: nn.Module, local: Sequence[GlobalSite], *, group=None, gather=all_gather):
    """The attention modules of every pipeline stage of ``model``, in module order: the layer numbers are their
    positions. One all-gather over the pipeline ``group`` per model and set of local modules (cached)."""
    key = tuple(s.name for s in local)
    cached = _ORDERS.setdefault(model, {})
    if key in cached:
        return cached[key]
    by_path: dict[tuple[int, ...], GlobalSite] = {}
    for stage, sites in enumerate(gather(list(local), group)):
        for site in sites:
            seen = by_path.setdefault(site.path, site)
            if seen.name != site.name:
                raise ShardLayoutError(
                    f"pipeline stage {stage} holds attention module {site.name!r} where another stage holds "
                    f"{seen.name!r}: the stages do not share one module tree (load every stage from one checkpoint)"
                )
    order = tuple(by_path[p] for p in sorted(by_path))
    cached[key] = order
    return order


# ----------------------------------------------------------------------------------------------- joining shards


def join_records(parts: Sequence[AttentionRecord]) -> AttentionRecord:
    """One record from the shards of one call (the records of one layer and call from every tensor-parallel
    process): tensors concatenated along their head axes in model-head order, key/value heads held by several
    processes kept once. ``meta["ranks"]`` lists the processes joined."""
    if not parts:
        raise ShardLayoutError("join_records() needs at least one record")
    parts = sorted(parts, key=lambda r: r.heads[0] if r.heads else -1)
    first = parts[0]
    for r in parts[1:]:
        if (r.name, r.layer, r.call, r.step, r.query_offset, r.num_heads, r.num_kv_heads) != (
            first.name,
            first.layer,
            first.call,
            first.step,
            first.query_offset,
            first.num_heads,
            first.num_kv_heads,
        ):
            raise ShardLayoutError(
                f"cannot join {r!r} with {first!r}: shards of one call share the module, layer, call, step, "
                "query_offset (the run of rows of capture(rows=)) and head counts"
            )
    heads = [h for r in parts for h in r.heads]
    if len(set(heads)) != len(heads):
        raise ShardLayoutError(
            f"layer {first.layer} ({first.name!r}), call {first.call}: the shards hold heads "
            f"{[list(r.heads) for r in parts]}, some twice; each process should hold its own heads"
        )
    kv_keep = [[i for i, h in enumerate(r.kv_heads) if h not in {k for p in parts[:j] for k in p.kv_heads}]
               for j, r in enumerate(parts)]  # fmt: skip
    changes: dict[str, Any] = {
        "heads": tuple(heads),
        "kv_heads": tuple(r.kv_heads[i] for r, keep in zip(parts, kv_keep) for i in keep),
    }
    for name in ("q", "scores", "weights", "output"):
        changes[name] = _cat([getattr(r, name) for r in parts], 1)  # (batch, head, ...)
    for name in ("k", "v"):
        tensors = [getattr(r, name) for r in parts]
        changes[name] = (
            None if any(t is None for t in tensors) else _cat([t[:, keep] for t, keep in zip(tensors, kv_keep)], 1)
        )
    if first.allowed is not None and first.allowed.shape[1] > 1:
        changes["allowed"] = _cat([r.allowed for r in parts], 1)  # (batch, head, query, key)
    changes["sinks"] = _cat([r.sinks for r in parts], 0)  # (head,)
    stats = [r.stats for r in parts]
    if all(s is not None for s in stats):  # every statistic is (batch, head, ...)
        changes["stats"] = {n: torch.cat([s[n] for s in stats if s is not None], 1) for n in stats[0] or {}}
    meta = {k: v for k, v in first.meta.items() if k not in RANK_KEYS}
    meta["ranks"] = sorted({r.meta.get("rank", i) for i, r in enumerate(parts)})
    changes["meta"] = meta
    changes["identified"] = frozenset.intersection(*(frozenset(r.identified) for r in parts))
    return replace(first, **changes)


def _cat(tensors: list, axis: int):
    if any(t is None for t in tensors):
        return None
    return torch.cat([t.cpu() if t.device != tensors[0].device else t for t in tensors], axis)


def join_capture_records(per_rank: Sequence[Sequence[AttentionRecord]]) -> list[AttentionRecord]:
    """Whole records from the records of every process: the shards of each call joined (``join_records``), the
    layers of every pipeline stage side by side. Processes that made the same calls in the same order keep that
    order; otherwise records are ordered by call, then layer."""
    # a call's runs of selected rows (capture(rows=)) are records of their own, told apart by query_offset
    keys = [[(r.layer, r.call, r.step, r.query_offset) for r in records] for records in per_rank]
    groups: dict[tuple, list[AttentionRecord]] = {}
    for records in per_rank:
        for r in records:
            groups.setdefault((r.layer, r.call, r.step, r.query_offset), []).append(r)
    if all(k == keys[0] for k in keys):
        order = keys[0]
    else:
        order = sorted(groups, key=lambda k: (k[1], -1 if k[2] is None else k[2], k[0], k[3]))
    return [join_records(groups[k]) for k in order]


def join(captures: Sequence) -> Any:
    """One Capture of whole records from the Captures of every process of a sharded model (e.g. each rank's
    ``Capture.save`` folder, read back with ``attnprobe.load``).

    Example::

        >>> import torch, attnprobe
        >>> from attnprobe.probe.shards import join
        >>> out, cap = attnprobe.run(attnprobe.MultiHeadAttention(8, num_heads=4), torch.randn(1, 3, 8))
        >>> halves = [cap.select(heads=[0, 1]), cap.select(heads=[2, 3])]
        >>> whole = join(halves)
        >>> whole[0].heads, torch.equal(whole[0].weights, cap[0].weights)
        ((0, 1, 2, 3), True)
    """
    from .capture import Capture

    if not captures:
        raise ShardLayoutError("join() needs the Capture of at least one process")
    records = join_capture_records([list(c) for c in captures])
    info = dict(captures[0].info)
    info.pop("layout", None)
    info.pop("held_layers", None)
    info["joined"] = len(captures)
    return Capture(records, info)
