"""Adapter for attnprobe's own ``MultiHeadAttention``: plain forward hooks on its hook points.

The hooks only hand tensors to ``deliver``; the records are made by the receiver, outside any compiled graph.
"""

from __future__ import annotations

from contextlib import ExitStack

from torch import nn

from ..probe.modules import MultiHeadAttention
from ..probe.threads import elsewhere
from .base import Adapter, Site
from .deliver import deliver, held, hold_recompile, listen, number, value_of
from .masks import forbids_future

_HOOKED = ("q", "k", "v", "scores", "weights", "output")
_IDENTIFIED = frozenset(_HOOKED) | {"allowed"}  # every field is read from a hook point


class OwnModuleAdapter(Adapter):
    name = "attnprobe"

    def find_named(self, model: nn.Module, named: list[tuple[str, nn.Module]], claimed: set[int]) -> list[Site]:
        return [
            Site(
                name,
                module,
                self,
                module.num_heads,
                module.num_heads,
                info={"strategy": "hook points", "backend": "attnprobe"},
            )
            for name, module in named
            if isinstance(module, MultiHeadAttention) and id(module) not in claimed
        ]

    def attach(self, session, model: nn.Module, sites: list[Site], stack: ExitStack) -> None:
        selected = [s for s in sites if s.selected]
        if not selected:
            return  # an idle capture touches nothing
        hold_recompile(session, stack)  # a model compiled before the capture runs these hooks too
        # compiled: every module gets its hooks, whatever is selected, so the graph compiled now serves later captures
        for site in sites if session.compiled else selected:
            self._attach_site(session, site, stack)

    def _attach_site(self, session, site: Site, stack: ExitStack) -> None:
        module = site.module
        assert isinstance(module, MultiHeadAttention)  # find_named makes sites of these only
        received = _Received(session, site, module)
        stack.callback(received.calls.clear)

        # -- inside the forward: hand the tensors over, nothing else (traceable by torch.compile) ----------
        def before(mod, args, kwargs):
            x, context = (tuple(args) + (None, None))[:2]
            deliver(
                token,
                "before",
                [
                    kwargs.get("x", x),
                    kwargs.get("context", context),
                    kwargs.get("attention_mask"),
                    kwargs.get("attn_mask"),
                ],
                [number(kwargs.get("is_causal"))],
            )

        def after(mod, args, output):
            deliver(token, "after", [], [])

        def stash(field):
            def hook(_mod, _inp, out):
                deliver(token, field, [out], [])

            return hook

        token = listen(module, "attnprobe", received.receive, stack)
        handles = [
            module.register_forward_pre_hook(before, with_kwargs=True),
            # not always_call (Dynamo guards on those hooks' ids): a forward that raises leaves its entry in `calls`,
            # below the entries of later calls, and the capture's exit drops it
            module.register_forward_hook(after),
            module.hook_allowed.register_forward_hook(stash("allowed")),
        ]
        for field in _HOOKED:  # every hook point, whatever is kept: a compiled graph serves every later capture
            handles.append(getattr(module, f"hook_{field}").register_forward_hook(stash(field)))
        for h in handles:
            stack.callback(h.remove)


class _Received:
    """The run-time side of one module's hooks (outside any compiled graph): the tensors its hook points delivered,
    gathered call by call into records."""

    def __init__(self, session, site: Site, module: MultiHeadAttention) -> None:
        self.session, self.site, self.module = session, site, module
        self.calls: list[dict] = []  # one entry per call in progress
        self.owner = session.thread  # calls from other threads pass through unrecorded
        # statistics of an own module come from the weights it computed (they are what is checked)
        self.kept = {field for field in _HOOKED if session.wants(site, field) or session.wants(site, "stats")}

    def receive(self, event: str, tensors: list, numbers: list) -> None:
        if elsewhere(self.owner):
            return
        calls = self.calls
        if event == "before":
            x, context, attention_mask, attn_mask = tensors
            info = self.module.resolve_call(
                x, context, attention_mask=attention_mask, attn_mask=attn_mask, is_causal=value_of(numbers[0])
            )
            calls.append({"info": info})
        elif event == "after":
            if calls:
                self._emit(calls.pop())
        elif calls:
            if event == "q":
                calls[-1]["dtype"] = tensors[0].dtype
            if event in self.kept or event == "allowed":
                calls[-1][event] = held(tensors[0])

    def _emit(self, seen: dict) -> None:
        session, site, mod = self.session, self.site, self.module
        info = seen.pop("info")
        out = seen.get("output")
        if out is not None:
            B, Tq, _ = out.shape  # merged (B, Tq, H*D) -> (B, H, Tq, D)
            seen["output"] = out.view(B, Tq, mod.num_heads, mod.d_head).transpose(1, 2)
        session.emit(
            site,
            kind=info.kind,
            query_padding=info.query_padding,
            # a causal attn_mask passed by the caller makes the call causal too, as torch's adapters read it
            causal=info.causal
            or (info.kind == "self" and seen.get("allowed") is not None and forbids_future(seen["allowed"])),
            scaling=mod.scaling,
            backend="attnprobe",
            dtype=seen.pop("dtype", None),
            weights_source="observed" if "weights" in seen else "none",
            dropout=mod.attn_dropout.p if mod.training else 0.0,
            identified=_IDENTIFIED | ({"query_padding"} if info.query_padding is not None else set()),
            meta={"module_class": type(mod).__name__},
            **seen,
        )
