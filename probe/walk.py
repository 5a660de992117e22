"""One walk of a model's module tree, shared by everything that reads the tree when a capture opens.

Opening a capture used to walk the tree once per reader (site discovery, the parent map, the config objects, the
encoder/decoder split, compiled modules, the search for code that calls sdpa): six walks of the 120-module MiniLM
took about a millisecond, as much as the capture's per-layer work of a short forward. A ``ModuleWalk`` is
``list(model.named_modules())`` with what those readers derive from it, each computed once.
"""

from __future__ import annotations

import weakref

from torch import nn

_HAS_CONFIG: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # class -> whether it defines ``config``


class ModuleWalk(list):
    """``list(model.named_modules())``: (name, module) pairs in module order, each module once; ``parents`` and
    ``configs`` are computed on first use. Built when a capture opens and dropped when it closes: a model changed
    between captures is walked again."""

    def __init__(self, model: nn.Module, named=None) -> None:
        super().__init__(model.named_modules() if named is None else named)
        self._parents: dict[int, nn.Module] | None = None
        self._configs: list | None = None
        self._classes: frozenset[type] | None = None

    @property
    def classes(self) -> frozenset[type]:
        """The distinct classes of the modules."""
        if self._classes is None:
            self._classes = frozenset(type(m) for _, m in self)
        return self._classes

    @property
    def parents(self) -> dict[int, nn.Module]:
        """id(child) -> parent, for every module but the root; a module held by several parents maps to the
        first of them in module order."""
        if self._parents is None:
            parents: dict[int, nn.Module] = {}
            for _, parent in self:
                for child in parent._modules.values():  # children(), without its per-call set of seen ids
                    if child is not None:
                        parents.setdefault(id(child), parent)
            self._parents = parents
        return self._parents

    @property
    def configs(self) -> list[tuple[nn.Module, object]]:
        """(module, its ``config`` attribute) for every module that has one that is not None, in module order."""
        if self._configs is None:
            found = []
            for _, module in self:
                config = module.__dict__.get("config")  # a plain attribute: no __getattr__ and AttributeError
                if config is None and _defines_config(type(module)):  # a property, or a class attribute
                    config = getattr(module, "config", None)
                if config is not None:
                    found.append((module, config))
            self._configs = found
        return self._configs


def _defines_config(cls: type) -> bool:
    known = _HAS_CONFIG.get(cls)
    if known is None:
        known = _HAS_CONFIG[cls] = any("config" in vars(c) for c in cls.__mro__)
    return known


def walk_of(model: nn.Module, named=None) -> ModuleWalk:
    """``named`` when it is a walk already, else a walk of ``model`` (over ``named`` when given)."""
    return named if isinstance(named, ModuleWalk) else ModuleWalk(model, named)
