"""Which processes a scan runs in, and which inputs and rows each one takes.

``scan`` asks one object, whatever launched it:

- ``OneProcess``: no launcher, every chunk here;
- ``AccelerateProcesses``: ``accelerate launch`` / ``torchrun`` with a whole model per process: each process takes its
  own chunks (accelerate's ``split_between_processes``) and writes their rows;
- ``ShardedProcesses``: a model split across processes (tensor or pipeline parallelism, ``probe/shards.py``): the
  inputs are split by data-parallel rank only, since the processes that hold parts of one model copy must run it on
  the same inputs; each of them aggregates the rows of its own heads and layers, and the first process of the copy
  writes them all, in the order one process would have written them (one gather per batch over the copy's group).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from ..shards import ShardLayout, ShardLayoutError, all_gather


class OneProcess:
    """A scan in one process."""

    main = True  # creates the folder, writes _scan.json and _manifest.json
    writes = True  # writes part files
    index = 0  # the process number in part metadata
    count = 1

    def wait(self) -> None:
        pass

    def agree(self, config: dict) -> None:
        """Refuse processes that would scan different things (one process agrees with itself)."""

    def share(self, chunks: list[int]) -> list[int]:
        return chunks

    def idle_batches(self, batches_of) -> int:
        """Forwards this process runs after its own, discarding their rows, so that every process runs as many
        (``batches_of(chunks)``: the forwards a share of chunks takes)."""
        return 0

    def combine(self, columns: dict[str, list]) -> dict[str, list] | None:
        return columns

    def describe(self) -> dict:
        return {}


class AccelerateProcesses(OneProcess):
    """Several processes, each with the whole model (accelerate's ``PartialState``)."""

    def __init__(self, state) -> None:
        self.state = state
        self.main = state.is_main_process
        self.index = state.process_index
        self.count = state.num_processes

    def wait(self) -> None:
        self.state.wait_for_everyone()

    def share(self, chunks: list[int]) -> list[int]:
        if self.count == 1:
            return chunks
        with self.state.split_between_processes(chunks) as share:
            return list(share)


class ShardedProcesses(OneProcess):
    """Several processes that split the model: inputs by data-parallel rank, rows written by each copy's first
    process."""

    def __init__(self, layout: ShardLayout) -> None:
        import torch.distributed as dist

        if dist.get_world_size() != layout.world:
            raise ShardLayoutError(
                f"the model's device mesh holds {layout.world} processes but {dist.get_world_size()} were launched: "
                "a scan splits its inputs by the mesh's data-parallel rank, so every process must be in the mesh "
                "(launch as many processes as the mesh has)",
                dims=layout.sizes,
            )
        self.layout = layout
        self.main = layout.rank == 0
        self.index = layout.rank
        self.count = layout.dp_size
        self.writes = layout.shard_rank == 0
        groups, mine = layout.shard_groups()
        self._leaders = [g[0] for g in groups]
        self._group = None
        if layout.sharded:
            made = [dist.new_group(g) for g in groups]  # every process makes every group, in the same order
            self._group = made[mine]

    def wait(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def agree(self, config: dict) -> None:
        """Refuse processes that would scan different things (their data, options or model differ)."""
        text = json.dumps(config, sort_keys=True, default=str)
        seen = all_gather(text, None)
        if len(set(seen)) > 1:
            differ = sorted(k for k in config if any(json.loads(s).get(k) != json.loads(seen[0]).get(k) for s in seen))
            raise ShardLayoutError(
                f"the processes of this scan disagree on its {', '.join(differ) or 'description'}: the processes of "
                "a sharded model must run it on the same inputs (give every process the same data and options)",
                dims=self.layout.sizes,
            )

    def share(self, chunks: list[int]) -> list[int]:
        self._shares = split_evenly(chunks, self.count)
        return self._shares[self.layout.dp_rank]

    def idle_batches(self, batches_of) -> int:
        """A forward of a model sharded by FSDP gathers parameters from every process: all run as many forwards."""
        counts = [batches_of(share) for share in self._shares]
        return max(counts) - counts[self.layout.dp_rank]

    def combine(self, columns: dict[str, list]) -> dict[str, list] | None:
        """Every row of this batch on the copy's first process (None elsewhere), in one process's row order:
        records in call and layer order, then input, then head."""
        if self._group is None:
            return columns
        import torch.distributed as dist

        leader = self._leaders[self.layout.dp_rank]
        parts: list | None = [None] * dist.get_world_size(self._group) if self.writes else None
        dist.gather_object(columns, parts, dst=leader, group=self._group)
        if parts is None:
            return None
        return sort_rows(merge_columns(parts))

    def describe(self) -> dict:
        return {"layout": self.layout.describe()}


def split_evenly(items: Sequence, parts: int) -> list[list]:
    """``items`` in ``parts`` consecutive runs, the first runs one longer when they do not divide evenly (as
    accelerate's ``split_between_processes`` splits)."""
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + size + (i < extra)
        out.append(list(items[start:stop]))
        start = stop
    return out


def merge_columns(parts: Sequence[dict[str, list]]) -> dict[str, list]:
    names = list(parts[0])
    return {n: [v for p in parts for v in p[n]] for n in names}


def sort_rows(columns: dict[str, list]) -> dict[str, list]:
    """Rows ordered by call, layer, input and head (the order of one process's scan of one batch)."""
    keys = list(zip(columns["call"], columns["layer"], columns["input"], columns["head"]))
    order = sorted(range(len(keys)), key=keys.__getitem__)
    return {n: [values[i] for i in order] for n, values in columns.items()}
