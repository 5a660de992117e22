"""The capture session of a sharded model: records with the model's own head and layer numbers on every process.

``ShardedSession`` is the ``CaptureSession`` that ``attnprobe.capture`` opens when the model runs in several
processes that split it (``probe/shards.py``: the layout, head shards, the global layer order):

- tensor parallelism: on the first call of each recorded module, one all-gather over the tensor-parallel group of the
  local head counts gives this process's head offsets (cached per module); records carry model head and key/value
  head numbers and the module's whole head counts, and a ``heads=`` selection names model heads (a process keeps those
  it holds, and makes no record for a call where it holds none);
- pipeline parallelism: when the capture opens, one all-gather over the pipeline group of every stage's attention
  modules (cached per model) numbers the layers in the model's module order; ``Capture.info["held_layers"]`` says
  which this process holds, ``info["attention_modules"]`` lists all of them;
- every record says which process made it (``record.meta["rank"]``, and ``tp_rank``, ``pp_rank``, ``dp_rank`` where
  those dimensions are split); ``Capture.info["layout"]`` describes the mesh;
- ``gather=True``: when the block ends, every process of a model copy gets the whole records of that copy
  (``shards.join_capture_records``); ``gather="main"``: only global rank 0 does, the others keep their own shard.

Every process of the mesh must open and close its captures together (as it runs the model's forwards together).
"""

from __future__ import annotations

import weakref
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from .capture import CaptureSession
from .errors import SelectionError
from .record import AttentionRecord
from .selection import kv_heads_for
from .shards import (
    GlobalSite,
    HeadShard,
    ShardLayout,
    ShardLayoutError,
    all_gather,
    global_layer_order,
    join_capture_records,
    module_paths,
)

GATHER_MODES = (False, True, "main")

#: module -> {(local heads, local key/value heads): its shard}: one all-gather per module and process, ever
_HEAD_SHARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class ShardedSession(CaptureSession):
    """A capture session that labels records with the model's head and layer numbers (see the module docstring)."""

    def __init__(self, model, selection, adapters, *, layout: ShardLayout, gather=False, **options) -> None:
        if gather not in GATHER_MODES:
            raise SelectionError(f"gather must be False, True or 'main', got {gather!r}")
        super().__init__(model, selection, adapters, **options)
        self.layout = layout
        self.gather = gather
        self._running = False
        self._declared: dict[int, tuple[int | None, int | None]] = {}  # id(site) -> head counts before the run
        self._shards: dict[int, HeadShard] = {}  # id(site) -> its head shard (tensor parallelism)
        self._by_layer: dict[int, Any] = {}  # layer -> site
        self._order: tuple[GlobalSite, ...] | None = None  # every stage's attention modules (pipeline)
        self._store = options.get("store")

    # -- layers ----------------------------------------------------------------------------
    def discover(self) -> list:
        sites = super().discover()
        if self.layout.pp_size > 1:
            model = self._require_model()
            paths = module_paths(model)
            local = [GlobalSite(paths[id(s.module)], s.name, s.num_heads, s.num_kv_heads) for s in sites]
            self._order = global_layer_order(model, local, group=self.layout.group("pp"))
            number = {g.name: i for i, g in enumerate(self._order)}
            for site in sites:
                site.layer = number[site.name]
        self._by_layer = {s.layer: s for s in sites}
        self._declared = {id(s): (s.num_heads, s.num_kv_heads) for s in sites}
        return sites

    def layer_count(self) -> int:
        """Every stage's attention layers (and those found while the model runs), not only this stage's."""
        if self._order is None:
            return super().layer_count()
        return len(self._order) + len(self.sites) - self.static_sites

    def add_site(self, site) -> None:
        super().add_site(site)
        if self._order is not None:  # found while the model runs: numbered after every stage's layers
            site.layer = len(self._order) + len(self.sites) - 1 - self.static_sites
            self.select_site(site)
        self._by_layer[site.layer] = site

    # -- heads -----------------------------------------------------------------------------
    def select_site(self, site) -> None:
        if self._running and self.layout.tp_size > 1 and site.num_heads is not None:
            self._resolve(site)
        shard = self._shards.get(id(site))
        if shard is None:
            super().select_site(site)
            return
        site.selected = self.selection.wants(site.layer)
        if site.selected:
            wanted = self.selection.heads_for(site.layer, shard.num_heads, where=f"({site.name!r})")
            site.heads = shard.locals(wanted)
            site.kv_heads = kv_heads_for(site.heads, shard.local_heads, shard.local_kv_heads)

    def _resolve(self, site) -> HeadShard:
        """This process's heads of ``site``'s module: one all-gather of the local counts over the tensor-parallel
        group on the module's first recorded call (cached for later captures)."""
        local = (site.num_heads, site.num_kv_heads or site.num_heads)
        known = _HEAD_SHARDS.setdefault(site.module, {})
        shard = known.get(local)
        if shard is None:
            counts = all_gather(local, self.layout.group("tp"))
            where = f"layer {site.layer} ({site.name!r})"
            shard = HeadShard.from_counts(
                counts, self.layout.tp_rank, self._declared.get(id(site), (None, None)), where
            )
            known[local] = shard
        self._shards[id(site)] = shard
        return shard

    def emit(self, site, *, kind: str, num_heads=None, num_kv_heads=None, **values) -> AttentionRecord | None:
        if site.selected and self.layout.tp_size > 1 and id(site) not in self._shards:
            if num_heads is not None and site.num_heads is None:
                site.num_heads, site.num_kv_heads = num_heads, num_kv_heads or num_heads
            if site.num_heads is not None:
                self.select_site(site)  # resolves the shard (every process of the group reaches this call)
        if site.selected and id(site) in self._shards and not site.heads:
            site.calls += 1  # this process holds none of the selected heads: no record, the call still counts
            site.selected = False  # (and the capture does not warn that a selected layer never ran)
            return None
        return super().emit(site, kind=kind, num_heads=num_heads, num_kv_heads=num_kv_heads, **values)

    def label(self, record: AttentionRecord) -> AttentionRecord:
        """The record with model head numbers and whole head counts, and the process that made it in its meta."""
        record = super().label(record)
        changes: dict[str, Any] = {"meta": {**record.meta, **self.layout.rank_meta()}}
        shard = self._shards.get(id(self._by_layer.get(record.layer)))
        if shard is not None:
            changes["heads"] = shard.globals(record.heads)
            changes["kv_heads"] = shard.globals(record.kv_heads, kv=True)
            changes["num_heads"], changes["num_kv_heads"] = shard.num_heads, shard.num_kv_heads
        return replace(record, **changes)

    # -- lifecycle -------------------------------------------------------------------------
    def __enter__(self):
        if self._store is not None and self.layout.world > 1:
            folders = all_gather(str(self._store), None)
            if len(set(folders)) < len(folders):
                raise ShardLayoutError(
                    f"capture(store={self._store!r}) names one folder for {len(folders)} processes: give each its "
                    "own, e.g. store=f'capture-rank{torch.distributed.get_rank()}' (attnprobe.join combines them)"
                )
        capture = super().__enter__()
        self._running = True
        return capture

    def __exit__(self, exc_type, exc, tb) -> None:
        self._running = False
        super().__exit__(exc_type, exc, tb)
        self.capture._info = MappingProxyType(self._info())  # head counts learned while the model ran
        if exc_type is None and self.gather and self.layout.sharded:
            self._gather()

    def _gather(self) -> None:
        """Whole records for every process of this model copy (``gather=True``) or global rank 0 only."""
        mine = (self.layout.dp_rank, list(self.capture))
        everyone = all_gather(mine, None)
        if self.gather == "main" and self.layout.rank != 0:
            return
        shards = [records for dp, records in everyone if dp == self.layout.dp_rank]
        self.capture._records = join_capture_records(shards)
        info = dict(self.capture.info)
        info["held_layers"] = tuple(sorted({r.layer for r in self.capture}))
        info["gathered"] = True
        self.capture._info = MappingProxyType(info)

    def _info(self) -> dict[str, Any]:
        info = super()._info()
        sites = sorted(self.sites, key=lambda s: s.layer)
        heads = {s.layer: self._global_counts(s) for s in sites}
        if self._order is not None:
            info["attention_modules"] = tuple(g.name for g in self._order)
            info["num_heads"] = tuple(heads.get(i, (g.num_heads,))[0] for i, g in enumerate(self._order))
            info["num_kv_heads"] = tuple(heads.get(i, (None, g.num_kv_heads))[1] for i, g in enumerate(self._order))
        else:
            info["num_heads"] = tuple(heads[s.layer][0] for s in sites)
            info["num_kv_heads"] = tuple(heads[s.layer][1] for s in sites)
        info["layout"] = self.layout.describe()
        info["held_layers"] = tuple(s.layer for s in sites)
        return info

    def _global_counts(self, site) -> tuple[int | None, int | None]:
        shard = self._shards.get(id(site))
        if shard is not None:
            return shard.num_heads, shard.num_kv_heads
        declared = self._declared.get(id(site))
        if self.layout.tp_size > 1 and declared is not None:
            return declared  # not called yet: the module's own (whole-model) counts
        return site.num_heads, site.num_kv_heads
