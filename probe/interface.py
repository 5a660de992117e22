"""The seam between the capture session (probe/) and the adapters (hooks/).

The core owns the contract, the adapters plug into it: the session knows an adapter only as an ``Adapter``
(``find_named``, ``may_find_more``, ``attach``) and each attention module it reads only as a ``Site``; an
adapter knows the session only as a ``Session`` (what is selected, ``emit`` a record, ``add_site`` for attention
found while the model runs). Nothing here imports an adapter: ``attnprobe.capture`` hands the session the
adapters of ``hooks.default_adapters()``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn

    from .record import AttentionRecord
    from .selection import Selection
    from .walk import ModuleWalk


@dataclass(frozen=True)
class Lazy:
    """A tensor an adapter can produce on demand, already restricted to the selected heads.

    ``shape`` and ``dtype`` are what ``fn()`` will return, so the budget is checked before the work.
    ``fn()`` returns a tensor the record keeps without another copy: a new one, or one the model never writes into
    again (the weights an eager attention function returned, which ``output_attentions`` hands out as they are).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    fn: Callable[[], torch.Tensor]


@dataclass(eq=False)
class Site:
    """One attention module as one capture session sees it."""

    name: str
    module: nn.Module
    adapter: Adapter
    num_heads: int | None = None
    num_kv_heads: int | None = None
    layer: int = -1  # assigned by the session, in module order
    selected: bool = False
    heads: tuple[int, ...] | None = None  # selected query heads (None until num_heads is known)
    kv_heads: tuple[int, ...] | None = None
    calls: int = 0  # calls seen in this session
    info: dict = field(default_factory=dict)  # adapter-specific, e.g. the strategy that will be used


class Session(Protocol):
    """What an adapter may use of the capture session that attached it (``probe.capture.CaptureSession``)."""

    selection: Selection
    """Layers, heads, kept tensors, storage device and dtype, byte budget."""
    sites: list[Site]
    """Every site of the capture, in layer order (sites found while the model runs come last)."""
    thread: int
    """The thread that opened the capture: hooks let other threads' calls pass (``probe.threads.elsewhere``)."""

    @property
    def walk(self) -> ModuleWalk | None:
        """The model's modules as walked when the capture opened (``list(model.named_modules())`` with the parent
        map and the config objects, each derived once): adapters read the tree from it instead of walking it."""
        ...

    @property
    def compiled(self) -> list[str]:
        """Names of the model's modules compiled with ``torch.compile`` (adapters make their hooks reach them)."""
        ...

    @property
    def stats_only(self) -> bool:
        """A statistics capture that keeps no (query, key) tensor: adapters hand over what the engine reads in
        blocks and build no (query, key) mask."""

    def wants(self, site: Site, field: str | None = None) -> bool:
        """Whether ``site`` is selected (and, with ``field``, whether that tensor is kept)."""

    def select_site(self, site: Site) -> None:
        """(Re)compute ``site.selected``, ``site.heads`` and ``site.kv_heads``, e.g. once its head count is known."""

    def add_site(self, site: Site) -> None:
        """Register a site found while the model runs; it gets the next layer number."""

    def emit(
        self,
        site: Site,
        *,
        kind: str,
        num_heads: int | None = None,
        num_kv_heads: int | None = None,
        preselected: Iterable[str] = (),
        **values: Any,
    ) -> AttentionRecord | None:
        """Build, budget and store one record for ``site`` (None for unselected sites)."""


class Adapter:
    """Base class: subclasses set ``name`` and implement ``attach``, and ``find`` or ``find_named``.

    An adapter finds the attention modules it can read and attaches hooks for one capture session; everything
    it attaches is undone through the session's ExitStack.
    """

    name: str = "adapter"
    #: True for adapters that may discover attention only while the model runs (functional
    #: interception): layer numbers beyond the statically found modules are then possible.
    dynamic: bool = False

    def find(self, model: nn.Module, claimed: set[int]) -> list[Site]:
        """Sites for the modules of ``model`` this adapter reads, skipping ids in ``claimed``. The default walks the
        modules for ``find_named``, for adapters that implement that one."""
        if type(self).find_named is Adapter.find_named:
            raise NotImplementedError(f"{type(self).__name__} implements neither find nor find_named")
        return self.find_named(model, list(model.named_modules()), claimed)

    def find_named(self, model: nn.Module, named: list[tuple[str, nn.Module]], claimed: set[int]) -> list[Site]:
        """``find`` given ``named = list(model.named_modules())``, walked once by the session for every adapter.

        Adapters that walk the modules override this instead of walking them again; the default calls ``find``.
        """
        return self.find(model, claimed)

    def may_find_more(self, model: nn.Module, claimed: set[int]) -> bool:
        """For dynamic adapters: whether running ``model`` could reveal attention beyond the sites found
        (``claimed`` holds their module ids). False lets the session check layer numbers up front."""
        return self.dynamic

    def attach(self, session: Session, model: nn.Module, sites: list[Site], stack: ExitStack) -> None:
        """Install hooks for ``sites``; register every undo step on ``stack``."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"
