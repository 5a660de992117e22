"""Adapter for attnprobe's own ``MultiHeadAttention``: plain forward hooks on its hook points."""

from __future__ import annotations

from contextlib import ExitStack

from torch import nn

from ..probe.modules import MultiHeadAttention
from ..probe.threads import elsewhere
from .base import Adapter, Site
from .masks import forbids_future

_HOOKED = ("q", "k", "v", "scores", "weights", "output")
_IDENTIFIED = frozenset(_HOOKED) | {"allowed"}  # every field is read from a hook point


class OwnModuleAdapter(Adapter):
    name = "attnprobe"

    def find(self, model: nn.Module, claimed: set[int]) -> list[Site]:
        return self.find_named(model, list(model.named_modules()), claimed)

    def find_named(self, model: nn.Module, named: list[tuple[str, nn.Module]], claimed: set[int]) -> list[Site]:
        return [
            Site(name, module, self, module.num_heads, module.num_heads, info={"strategy": "hook points", "backend": "attnprobe"})
            for name, module in named
            if isinstance(module, MultiHeadAttention) and id(module) not in claimed
        ]

    def attach(self, session, model: nn.Module, sites: list[Site], stack: ExitStack) -> None:
        for site in sites:
            if site.selected:
                self._attach_site(session, site, stack)

    def _attach_site(self, session, site: Site, stack: ExitStack) -> None:
        module: MultiHeadAttention = site.module
        calls: list[dict] = []  # one entry per call in progress
        owner = session.thread  # calls from other threads pass through unrecorded

        def before(mod, args, kwargs):
            if elsewhere(owner):
                return
            calls.append({"info": mod.resolve_call(*args, **kwargs)})

        def after(mod, args, kwargs, output):
            if not calls or elsewhere(owner):
                return  # the forward failed before our pre-hook ran, or another thread's call
            seen = calls.pop()
            if output is None:
                return  # the forward raised (always_call): nothing to record
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
                causal=info.causal or (info.kind == "self" and seen.get("allowed") is not None
                                       and forbids_future(seen["allowed"])),
                scaling=mod.scaling,
                backend="attnprobe",
                dtype=seen.pop("dtype", None),
                weights_source="observed" if "weights" in seen else "none",
                dropout=mod.attn_dropout.p if mod.training else 0.0,
                identified=_IDENTIFIED | ({"query_padding"} if info.query_padding is not None else set()),
                meta={"module_class": type(mod).__name__},
                **seen,
            )

        def stash(field):
            def hook(_mod, _inp, out):
                if calls and not elsewhere(owner):
                    calls[-1][field] = out
            return hook

        def note_dtype(_mod, _inp, q):
            if calls and not elsewhere(owner):
                calls[-1]["dtype"] = q.dtype

        handles = [
            module.register_forward_pre_hook(before, with_kwargs=True),
            module.register_forward_hook(after, with_kwargs=True, always_call=True),
            module.hook_allowed.register_forward_hook(stash("allowed")),
            module.hook_q.register_forward_hook(note_dtype),
        ]
        for field in _HOOKED:
            # statistics of an own module come from the weights it computed (they are what is checked)
            if session.wants(site, field) or session.wants(site, "stats"):
                handles.append(getattr(module, f"hook_{field}").register_forward_hook(stash(field)))
        for h in handles:
            stack.callback(h.remove)
