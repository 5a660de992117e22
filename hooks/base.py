"""What every adapter provides. An adapter finds the attention modules it can read and attaches
hooks for one capture session; everything it attaches is undone through the session's ExitStack."""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:  # pragma: no cover
    from ..probe.capture import CaptureSession


@dataclass(eq=False)
class Site:
    """One attention module as one capture session sees it."""

    name: str
    module: nn.Module
    adapter: "Adapter"
    num_heads: int | None = None
    num_kv_heads: int | None = None
    layer: int = -1  # assigned by the session, in module order
    selected: bool = False
    heads: tuple[int, ...] | None = None  # selected query heads (None until num_heads is known)
    kv_heads: tuple[int, ...] | None = None
    calls: int = 0  # calls seen in this session
    info: dict = field(default_factory=dict)  # adapter-specific, e.g. the strategy that will be used


class Adapter:
    """Base class: subclasses set ``name`` and implement ``find`` and ``attach``."""

    name: str = "adapter"
    #: True for adapters that may discover attention only while the model runs (functional
    #: interception): layer numbers beyond the statically found modules are then possible.
    dynamic: bool = False

    def find(self, model: nn.Module, claimed: set[int]) -> list[Site]:
        """Sites for the modules of ``model`` this adapter reads, skipping ids in ``claimed``."""
        raise NotImplementedError

    def find_named(self, model: nn.Module, named: list[tuple[str, nn.Module]], claimed: set[int]) -> list[Site]:
        """``find`` given ``named = list(model.named_modules())``, walked once by the session for every adapter.

        Adapters that walk the modules override this instead of walking them again; the default calls ``find``.
        """
        return self.find(model, claimed)

    def may_find_more(self, model: nn.Module, claimed: set[int]) -> bool:
        """For dynamic adapters: whether running ``model`` could reveal attention beyond the sites found
        (``claimed`` holds their module ids). False lets the session check layer numbers up front."""
        return self.dynamic

    def attach(self, session: "CaptureSession", model: nn.Module, sites: list[Site], stack: ExitStack) -> None:
        """Install hooks for ``sites``; register every undo step on ``stack``."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"
