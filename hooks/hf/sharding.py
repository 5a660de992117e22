"""Where a Hugging Face model loaded across processes sits: its device mesh, read as a ``probe.shards.ShardLayout``.

``from_pretrained(..., distributed_config=DistributedConfig(tp_size=..., pp_size=..., fsdp_size=...))`` (transformers
5.x, under ``torchrun``) builds a mesh of named dimensions (``pp``, ``dp_replicate``, ``fsdp``, ``tp``) and keeps it on
the model: the whole dense mesh on its mesh manager (transformers 5.24), or the ``(pp, fsdp, tp)`` mesh as
``_device_mesh``. These are transformers internals, read here only.
"""

from __future__ import annotations

from torch import nn

from ...probe.shards import ShardLayout


def device_mesh(model: nn.Module):
    """The model's dense device mesh (named dimensions), or None for a model in one process."""
    for module in (model, *_owners(model)):
        manager = getattr(module, "_mesh_manager", None)
        mesh = getattr(manager, "_dense_mesh", None)
        if mesh is None:
            mesh = getattr(module, "_device_mesh", None)
        if mesh is not None and getattr(mesh, "mesh_dim_names", None):
            return mesh
    return None


def _owners(model: nn.Module):
    """Modules that may carry the mesh when the model given is a part of a distributed model: none can be found
    from below (a module does not know its parent), so only the model's own submodules that are whole models."""
    return (m for _, m in model.named_children() if hasattr(m, "_mesh_manager") or hasattr(m, "_device_mesh"))


def shard_layout(model: nn.Module) -> ShardLayout | None:
    """This process's place in ``model``'s mesh, or None when the model runs in one process (no mesh, or a mesh of
    one process)."""
    mesh = device_mesh(model)
    if mesh is None or mesh.size() <= 1:
        return None
    return ShardLayout.from_mesh(mesh)
