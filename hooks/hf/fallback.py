"""Old-style Hugging Face models (no attention interface): weights only, through ``output_attentions``.

About 90 model families in transformers 5.x (bloom, falcon, gpt_neo, gptj, codegen, deberta-v2, ...)
compute attention inside their own module code, with no seam for a wrapper. For those, a capture
asks the model for ``output_attentions=True`` and reads each attention module's weights from its
return value. q, k, v, scores, output and the mask stay unobserved (None); the caller's output is
handed back exactly as they asked for it (attentions removed when they did not ask for them).
"""

from __future__ import annotations

import inspect
from contextlib import ExitStack

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ...probe.errors import UnsupportedModelError, warn_user
from ...probe.threads import current, elsewhere
from ..calls import bind_arguments
from ..deliver import deliver, held, hold_recompile, listen, number
from ..functional import code_reaches_sdpa
from ..modes import exit_mode
from . import compat as hf_compat
from .context import HEAD_ATTRS, KindProbe, ancestors, argument, call_kind, forward_params, static_kind
from .expects import config_expects, decoder_expects, text_decoder_expects
from .source import averages_heads, calls_functional_dropout, name_branches, record_dtype, softmax_dtype

_MISSING = ("q", "k", "v", "scores", "output", "allowed")
#: Old-style modules whose returned weights are not a (query, key) matrix (local windows, buckets).
_OWN_LAYOUT = frozenset(
    {
        "LongformerSelfAttention",
        "LEDEncoderSelfAttention",
        "BigBirdBlockSparseAttention",
        "LSHSelfAttention",
        "LocalSelfAttention",
        "NeighborhoodAttention",
        "LongT5LocalAttention",
        "LongT5TransientGlobalAttention",
    }
)
#: Old-style modules that return their weights time-first, ``(query, key, batch, head)`` (XLNet's
#: "ijbn"); the fallback permutes them to ``(batch, head, query, key)``. Their keys after a memory
#: (XLNet's ``mems``) come after the remembered ones, so the first query sits at ``key - query``.
_TIME_FIRST = frozenset({"XLNetRelativeAttention"})
#: Old-style modules whose output_attentions are the logits (plus the additive mask) the softmax is about
#: to see, not its result (ProphetNet's encoder and cross-attention, SqueezeBERT); the fallback applies
#: that very softmax call, ``softmax(x, dim=-1)``, to record the weights the module went on to use.
_PRE_SOFTMAX = frozenset({"ProphetNetAttention", "SqueezeBertSelfAttention"})


def is_old_style_model(module: nn.Module) -> bool:
    """A transformers model whose attention code does not go through the attention interface."""
    return hf_compat.can_set_implementation(type(module)) is False and _is_pretrained(module)


def _is_pretrained(module: nn.Module) -> bool:
    return isinstance(module, hf_compat.pretrained_model_class())


def find_old_style(
    model: nn.Module, taken: set[int], parents: dict, named: list | None = None
) -> list[tuple[str, nn.Module]]:
    """Innermost ``*Attention*`` modules with a head count inside transformers models, outside ``taken``
    (the modules the attention interface or another adapter reads).

    Old-style models have only such modules; a few models mix both kinds (LongT5's local encoder
    attention, BigBirdPegasus's encoder next to an interface decoder), and their old-style modules
    must not go unrecorded without a word.
    """
    named = list(model.named_modules()) if named is None else named
    candidates = []
    for name, module in named:
        cls = type(module)
        if id(module) in taken or "Attention" not in cls.__name__ or not cls.__module__.startswith("transformers."):
            continue
        if not any(isinstance(getattr(module, a, None), int) for a in HEAD_ATTRS) and not _config_heads(module):
            continue
        if _calls_sdpa_without_weights(cls):
            continue
        owner = next((m for m in ancestors(module, parents) if _is_pretrained(m)), None)
        if owner is not None:
            candidates.append((name, module))
    # keep the innermost: a wrapper around another attention module is not itself read, nor one around torch's
    # nn.MultiheadAttention, which the torch adapter reads (SigLIP2's pooling head keeps a head count of its own)
    torch_mha = [m for _, m in named if isinstance(m, nn.MultiheadAttention)]
    above = {id(a) for m in [*(m for _, m in candidates), *torch_mha] for a in ancestors(m, parents)}
    above |= {id(a) for key in taken for a in _ancestors_by_id(key, parents)}
    return [(name, m) for name, m in candidates if id(m) not in above]


def _config_heads(module: nn.Module) -> bool:
    """An attention module that keeps its head count only in its config (Funnel's
    ``FunnelRelMultiheadAttention``) and can be asked for weights; helpers such as
    ``FunnelAttentionStructure`` take no ``output_attentions`` and are not attention."""
    heads = getattr(getattr(module, "config", None), "num_attention_heads", None)
    return isinstance(heads, int) and heads > 0 and "output_attentions" in forward_params(type(module))


def _calls_sdpa_without_weights(cls: type) -> bool:
    """A module that calls ``F.scaled_dot_product_attention`` itself and cannot be asked for weights (its
    forward takes neither ``output_attentions`` nor ``**kwargs``: AIMv2's attention-pooling head). It is not
    old-style attention: output_attentions would return nothing, while the functional adapter reads its
    sdpa calls whole (q, k, v, mask, recomputed weights)."""
    forward = getattr(cls, "forward", None)
    if forward is None:
        return False
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):  # a forward inspect cannot read
        return False
    if any(p.name == "output_attentions" or p.kind is p.VAR_KEYWORD for p in params):
        return False
    return code_reaches_sdpa(cls)


def _ancestors_by_id(key: int, parents: dict[int, nn.Module]):
    m = parents.get(key)
    while m is not None:
        yield m
        m = parents.get(id(m))


class _ForceAttentions:
    """Makes one old-style model return attention weights, and hides them again from its caller."""

    def __init__(self, model: nn.Module, stack: ExitStack) -> None:
        self.model = model
        self.params = forward_params(type(model))
        self.calls: list[tuple[bool, bool]] = []  # (caller asked for attentions, caller wants a tuple)
        self._owner = current()  # other threads' calls run as if attnprobe were absent
        for handle in (
            model.register_forward_pre_hook(self._before, with_kwargs=True),
            model.register_forward_hook(self._after, with_kwargs=True, always_call=True),
        ):
            stack.callback(handle.remove)

    def _set(self, name: str, value, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        i = self.params.get(name, -1)
        if name not in kwargs and 0 <= i < len(args):
            args = args[:i] + (value,) + args[i + 1 :]
        else:
            kwargs[name] = value
        return args, kwargs

    def _before(self, module, args, kwargs):
        if elsewhere(self._owner):
            return None
        config = getattr(module, "config", None)  # FSMT's encoder keeps none
        asked = argument(self.params, "output_attentions", args, kwargs)
        asked = bool(getattr(config, "output_attentions", False) if asked is None else asked)
        return_dict = argument(self.params, "return_dict", args, kwargs)
        wants_tuple = (return_dict is False) or (return_dict is None and not getattr(config, "return_dict", True))
        self.calls.append((asked, wants_tuple))
        if asked:
            return None
        kwargs = dict(kwargs)
        args, kwargs = self._set("output_attentions", True, args, kwargs)
        if wants_tuple and "return_dict" in self.params:
            args, kwargs = self._set("return_dict", True, args, kwargs)
        return args, kwargs

    def _after(self, module, args, *rest):
        # (kwargs, output) as registered; (output) where torch calls it after the capture that registered it closed
        # inside this call (it iterates the hooks it had when the call's hooks began)
        output = rest[-1]
        if not self.calls or elsewhere(self._owner):
            return None
        asked, wants_tuple = self.calls.pop()
        if asked or output is None:
            return None
        if hasattr(output, "items") and hasattr(output, "to_tuple"):
            # rebuild the output the model would have returned without output_attentions
            output = type(output)(**{k: v for k, v in output.items() if not k.endswith("attentions")})
            return output.to_tuple() if wants_tuple else output
        raise UnsupportedModelError(
            f"{type(module).__name__} returned a {type(output).__name__} with output_attentions forced on; "
            "attnprobe cannot remove the attentions the caller did not ask for. Capture with layers=[] "
            "for this model, or call it with output_attentions=True and return_dict=True"
        )


def _weights_in(output) -> torch.Tensor | None:
    """The attention weights (4-D, in the module's own layout) in an old-style module's return value."""
    if isinstance(output, dict):  # SqueezeBERT: {"context_layer": ..., "attention_score": ...}
        output = tuple(output.values())
    if not isinstance(output, (tuple, list)) or not output:
        return None
    if isinstance(output[0], (tuple, list)):  # (outputs, scaling factor), as I-BERT returns
        return _weights_in(output[0])
    for item in output[1:]:  # item 0 is the attention output (batch-first or, in fsmt, time-first)
        if isinstance(item, torch.Tensor) and item.dim() == 4 and item.dtype.is_floating_point:
            return item
    return None


def _other_layout(output) -> tuple[int, ...] | None:
    """The shape of a floating tensor of 5 or more axes returned next to the attention output (Hiera's
    weights per mask unit, (batch, head, unit, query, key); PEGASUS-X's local weights per block, in a dict beside
    its global ones): weights, but not one matrix per call."""
    if isinstance(output, dict):
        output = tuple(output.values())
    if not isinstance(output, (tuple, list)) or not output:
        return None
    if isinstance(output[0], (tuple, list)):
        return _other_layout(output[0])
    for item in output[1:]:
        for t in item.values() if isinstance(item, dict) else (item,):
            if isinstance(t, torch.Tensor) and t.dim() >= 5 and t.dtype.is_floating_point:
                return tuple(t.shape)
    return None


def _several_weights(output) -> int:
    """How many 4-D weight tensors an old-style module returned inside one tuple item (XLNet's two streams)."""
    if not isinstance(output, (tuple, list)):
        return 0
    for item in output[1:]:
        if isinstance(item, (tuple, list)):
            found = [t for t in item if isinstance(t, torch.Tensor) and t.dim() == 4]
            if len(found) > 1:
                return len(found)
    return 0


def _chunked(module: nn.Module, parents: dict) -> bool:
    """Called once per local chunk by its parent (Canine's ``local=True`` attention): each call's weights
    cover one window whose position in the sequence the call does not say."""
    parent = parents.get(id(module))
    return getattr(parent, "local", None) is True and hasattr(parent, "attend_from_chunk_stride")


def _probabilities(weights: torch.Tensor, dropout: float = 0.0) -> bool:
    """Whether returned weights lie in [0, 1] (within the dtype's rounding), as post-softmax weights do; in
    [0, 1 / (1 - dropout)] for weights returned after the module's dropout (training: kept weights are scaled up).

    NaN is not evidence either way: Bloom and MPT in float64 return NaN rows for fully masked queries,
    which are their own weights (and reach their outputs)."""
    if not weights.dtype.is_floating_point or weights.numel() == 0:
        return True
    slack = 1e-3 if weights.dtype in (torch.float32, torch.float64) else 1e-2
    ceiling = 1.0 / (1.0 - dropout) if 0.0 < dropout < 1.0 else 1.0
    w = weights.detach()
    return not bool(((w < -slack) | (w > ceiling * (1 + slack))).any())  # comparisons with NaN are False


def _declared_heads(module: nn.Module) -> int | None:
    """The head count the module itself declares (an attribute, not the config)."""
    return next((v for a in HEAD_ATTRS if isinstance(v := getattr(module, a, None), int) and v > 0), None)


def _owners(module: nn.Module, parents: dict) -> list[nn.Module]:
    """The modules above ``module`` to ask for output_attentions: the transformers models, and the encoder a model's
    ``get_encoder()`` names (``generate`` calls it alone, and FSMT's is a plain module), where they take it."""
    chain = list(ancestors(module, parents))
    entries = {id(m) for m in chain if _is_pretrained(m)}
    for m in chain:
        encoder = _encoder_of(m) if id(m) in entries else None
        if encoder is not None and encoder is not m:
            entries.add(id(encoder))
    return [m for m in chain if id(m) in entries and "output_attentions" in forward_params(type(m))]


def _encoder_of(model: nn.Module) -> nn.Module | None:
    try:
        get_encoder = getattr(model, "get_encoder", None)
        encoder = get_encoder() if callable(get_encoder) else None
    except (AttributeError, NotImplementedError, TypeError, ValueError):
        return None
    return encoder if isinstance(encoder, nn.Module) else None


def _probability(module: nn.Module) -> float | None:
    """The probability of a dropout module: torch's nn.Dropout, or one of transformers' own that keeps it (SEW-D's
    StableDropout, ``drop_prob``); None for any other module."""
    if isinstance(module, nn.Dropout):
        return module.p
    if type(module).__name__.endswith("Dropout"):
        p = getattr(module, "drop_prob", getattr(module, "p", None))
        return float(p) if isinstance(p, (float, int)) and not isinstance(p, bool) else None
    return None


def _dropout_modules(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if _probability(m) is not None]


def _dropout_of(module: nn.Module, dropouts: list[nn.Module]) -> float:
    """The dropout the module applies while training: its dropout modules', or a probability it keeps for a functional
    dropout (a number in an attribute whose name says dropout: XLM's ``dropout``, ProphetNet's ``attention_dropout``,
    MPT's ``attn_dropout_p``); 0 in eval mode."""
    if not module.training:
        return 0.0
    ps = [_probability(m) or 0.0 for m in dropouts]  # its dropout modules, found once
    ps += [float(v) for n, v in vars(module).items() if "dropout" in n.lower() and type(v) in (float, int)]
    return max((p for p in ps if 0.0 < p < 1.0), default=0.0)


class _Undropped:
    """The weights an old-style module hands its attention dropout while training: the softmax's, delivered by
    pre-hooks on its dropout modules. Where the weights it returns are exactly those, dropped out and rescaled, they
    are recorded instead (the weights before dropout, as every other adapter records them)."""

    def __init__(self, module: nn.Module) -> None:
        self.dropouts = _dropout_modules(module)
        self.clear()

    def clear(self) -> None:
        """A new call of the module begins."""
        self.seen: list[tuple[torch.Tensor, float]] = []  # (a dropout's 4-D input, its p), this call's

    def saw(self, x: torch.Tensor, p: float) -> None:
        """One of the module's dropouts (training, ``p``) ran on ``x``, 4-D floating and not in place."""
        self.seen.append((held(x), p))

    def undrop(self, returned: torch.Tensor, p: float) -> tuple[torch.Tensor, bool]:
        """``returned`` (``(batch, head, query, key)`` weights of a module training with dropout ``p``) as its softmax
        gave them, and whether they are still after dropout. Its dropout's input where that explains them; else
        ``returned`` itself where its rows sum to one (a dropout that never reached them: Nystromformer keeps one
        it never applies, BART-style modules drop out a copy), and after dropout where they do not (WavLM's
        F.multi_head_attention_forward; nn.functional.dropout in a compiled graph)."""
        seen = self.seen
        self.clear()
        for x, q in reversed(seen):
            if x.shape == returned.shape and _dropped_from(returned, x, q):
                return x, False
        return returned, not _normalised(returned, p)


_DROPOUT_PARAMS = ("input", "p", "training", "inplace")
_DROPOUT_DEFAULTS = {"p": 0.5, "training": True, "inplace": False}


class _DropoutInputs(TorchFunctionMode):
    """On for one call of an old-style module in eager code: in training, each ``nn.functional.dropout`` call on 4-D
    floating values hands its input and ``p`` to ``seen`` (XLM, MPT and ProphetNet's decoder drop out the weights
    they return so). With ``heads``, ``F.multi_head_attention_forward`` asked for head-averaged weights (WavLM) runs
    with ``average_attn_weights=False``: ``heads`` gets its per-head weights, and the caller gets their mean over
    heads, as torch computes it (the same values, bit for bit). Every other call runs as called."""

    def __init__(self, seen, heads=None) -> None:
        super().__init__()
        self.seen, self.heads = seen, heads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.multi_head_attention_forward and self.heads is not None:
            return self._per_head(func, args, kwargs)
        call = None if func is not F.dropout else bind_arguments(_DROPOUT_PARAMS, _DROPOUT_DEFAULTS, args, kwargs, 1)
        if call is not None and call["training"] and not call["inplace"] and type(call["p"]) in (float, int):
            x, p = call["input"], float(call["p"])
            if isinstance(x, torch.Tensor) and x.dim() == 4 and x.dtype.is_floating_point and 0.0 < p < 1.0:
                self.seen(x, p)
        return func(*args, **kwargs)

    def _per_head(self, func, args, kwargs):
        try:
            bound = _MHA_SIGNATURE.bind(*args, **kwargs)
        except TypeError:
            return func(*args, **kwargs)  # torch raises its own error
        bound.apply_defaults()
        call = bound.arguments
        if not (call["need_weights"] and call["average_attn_weights"]):
            return func(*args, **kwargs)
        # its own calls (softmax, dropout) run inside this one, out of this mode's sight: in training the heads'
        # weights are after its dropout
        output, weights = func(**{**call, "average_attn_weights": False})  # (batch, head, query, key)
        if weights is None or weights.dim() != 4:
            return output, weights if weights is None else weights.mean(dim=-3)
        self.heads(weights)
        return output, weights.mean(dim=1)  # what torch returns for average_attn_weights=True


_MHA_SIGNATURE = inspect.signature(F.multi_head_attention_forward)


def _dropped_from(returned: torch.Tensor, x: torch.Tensor, p: float) -> bool:
    """Whether every value of ``returned`` is 0 or ``x / (1 - p)``, as nn.Dropout(p) leaves ``x`` (rounding aside)."""
    rtol = 1e-5 if returned.dtype in (torch.float32, torch.float64) else 1e-2
    with torch.no_grad():
        r = returned.detach()
        scaled = x.detach().to(r.dtype) / (1.0 - p)  # (batch, head, query, key)
        kept = torch.isclose(r, scaled, rtol=rtol, atol=0.0, equal_nan=True)
        return bool((kept | (r == 0)).all()) and bool(kept.any())


def _normalised(weights: torch.Tensor, p: float) -> bool:
    """Whether every row of ``weights`` sums to one (or to zero: a row with no key; NaN: no evidence), and some row to
    one, as a softmax's do and weights after a dropout of ``p`` do not: a row keeps ``(1 - dropped mass) / (1 - p)``,
    which is one only where the dropped mass is ``p`` exactly. False where the dtype's rounding cannot tell them
    apart (``p`` below twice the tolerance)."""
    tol = 1e-3 if weights.dtype in (torch.float32, torch.float64) else 1e-2
    if p / 2 <= tol:
        return False
    with torch.no_grad():
        sums = weights.detach().float().sum(-1)  # (batch, head, query)
        one = (sums - 1).abs() <= tol
        return bool((one | (sums == 0) | sums.isnan()).all()) and bool(one.any())


def attach_fallback(session, model: nn.Module, sites, surroundings, stack: ExitStack) -> None:
    """Weights-only records for ``sites`` (selected old-style modules) through output_attentions."""
    parents = surroundings.parents
    forced: dict[int, _ForceAttentions] = {}
    for site in sites:
        # models that take output_attentions are asked for weights; modules of the others (xglm)
        # return their weights anyway, or fail with a clear error on their first call
        owners = _owners(site.module, parents)
        if "Sdpa" in type(site.module).__name__:
            raise UnsupportedModelError(
                f"attention module {site.name!r} ({type(site.module).__name__}, layer {site.layer}) is the sdpa "
                "variant of an old-style attention class: it returns no weights even when asked for "
                "output_attentions, and has no attention interface. Load the model with attn_implementation='eager' "
                "to capture its weights, or exclude it with layers=[...]"
            )
        if type(site.module).__name__ in _OWN_LAYOUT or _chunked(site.module, parents):
            raise UnsupportedModelError(
                f"no adapter can read attention module {site.name!r} ({type(site.module).__name__}, layer "
                f"{site.layer}): its output_attentions weights are laid out per local window or bucket, not as "
                "(query, key). Exclude it with layers=[...]"
            )
        _refuse_if_path_changes(site, owners)
        for owner in owners:
            if id(owner) not in forced:
                forced[id(owner)] = _ForceAttentions(owner, stack)
        # inside a model that otherwise uses the interface, a module whose weights cannot be read (MiniMax's
        # lightning attention, deformable attention) is left out with a warning; old-style models refuse
        strict = any(is_old_style_model(m) for m in ancestors(site.module, parents))
        _FallbackSite(session, site, surroundings, stack, strict)

    models = sorted({type(m).__name__ for m in (f.model for f in forced.values())}) or [type(model).__name__]
    warn_user(
        f"{', '.join(models)}: no attention interface in {', '.join(sorted({type(s.module).__name__ for s in sites}))} "
        "(old-style attention code in transformers): attnprobe "
        f"falls back to output_attentions for {len(sites)} module(s) and records post-softmax weights only "
        f"(weights_source='output_attentions'). {', '.join(_MISSING)} are None because the model computes them "
        "inside its own forward, where no hook point exists; the model may also take its eager path to return "
        "weights. The output you asked for is unchanged." + _statistics_note(session.selection.keep)
    )


def _statistics_note(keep) -> str:
    """What a statistics capture of old-style modules costs: their statistics come from the weights, which the model
    holds for every layer until it returns."""
    if "stats" not in keep or "weights" in keep:
        return ""
    return (
        " Their statistics (keep='stats') are computed from those weights, which the model holds for every layer "
        "until it returns: memory grows as layers x (query x key), not bounded as for the attention interface; "
        "max_score, and the output's checks, need the scores and v these modules do not give."
    )


def _refuse_if_path_changes(site, owners) -> None:
    """Some old-style models compute attention another way when asked for weights (Falcon under sdpa)."""
    branches = name_branches(type(site.module).__module__)
    impls = {getattr(getattr(m, "config", None), "_attn_implementation", None) for m in owners}
    if branches and impls - {"eager", None}:
        raise UnsupportedModelError(
            f"attention module {site.name!r} ({type(site.module).__name__}, layer {site.layer}) computes attention "
            f"another way when asked for weights (its code branches on {branches[0]!r}), so forcing "
            "output_attentions would change the model's outputs. Load the model with attn_implementation='eager' "
            "to capture its weights, or exclude it with layers=[...]"
        )


class _FallbackSite:
    """The hooks on one selected old-style module (and on its dropouts): the weights in its return value, delivered
    (also from a compiled graph), then read and recorded outside the forward."""

    def __init__(self, session, site, surroundings, stack: ExitStack, strict: bool) -> None:
        module = site.module
        self.session, self.site, self.strict = session, site, strict
        self.owner = session.thread  # other threads' forwards are not read
        self.state = surroundings.stack_of(module)  # the model's generation state (cache, step, padding)
        self.kind = static_kind(module)
        self.probe = KindProbe(module, stack) if self.kind is None else None
        self.meta = {
            "module_class": type(module).__name__,
            "layer_idx": getattr(module, "layer_idx", None),
            "base": "output_attentions",
        }
        part = surroundings.part_of(module)
        if part is not None:
            self.meta["stack"] = part
        expects = config_expects(module, part, getattr(self.state, "config", None))  # what the config declares
        expects.update(text_decoder_expects(self.state, part))
        if expects:
            self.meta["expects"] = expects
        self.softmax = softmax_dtype(type(module).forward)  # Bloom's and MPT's run in float32 whatever the dtype
        self.time_first = type(module).__name__ in _TIME_FIRST
        self.pre_softmax = type(module).__name__ in _PRE_SOFTMAX
        self.declared = _declared_heads(module)
        self.warned = False  # this capture has said once that the module is left out
        self.dropout_warned = False  # ... that its weights after dropout give no statistics
        self.averaged_warned = False  # ... that its records hold the mean over heads
        self.undropped = _Undropped(module)  # its weights before its dropout, in training
        self.mode: _DropoutInputs | None = None  # on during a training call that calls nn.functional.dropout
        self.averaged = averages_heads(type(module))  # its weights are a mean over heads (WavLM): read them per head
        self.per_head: torch.Tensor | None = None  # this call's per-head weights, read by the mode (eager code)
        stack.callback(self._leave)
        self._hook(module, session, stack)

    def _hook(self, module: nn.Module, session, stack: ExitStack) -> None:
        """Hooks that hand what they see to ``receive`` and do nothing else (traceable by torch.compile)."""
        token = 0
        functional = calls_functional_dropout(type(module))

        def called(module, args) -> None:
            deliver(token, "call", [], [])
            if ((functional and module.training) or self.averaged) and not torch.compiler.is_compiling():
                self._enter()

        def dropping(dropout: nn.Module, args) -> None:
            x, p = args[0] if args else None, _probability(dropout) or 0.0
            readable = isinstance(x, torch.Tensor) and x.dim() == 4 and x.dtype.is_floating_point
            if dropout.training and 0.0 < p < 1.0 and readable and not getattr(dropout, "inplace", False):
                deliver(token, "dropout", [x], [p])

        def returned(module, args, output) -> None:
            per_head = None
            if not torch.compiler.is_compiling():
                self._leave()
                per_head, self.per_head = self.per_head, None
            weights = _weights_in(output)  # in the module's own layout
            if weights is not None and per_head is not None and per_head.shape == weights.shape:
                deliver(token, "weights", [per_head], [1.0])  # the heads' own, where it broadcast their mean
            elif weights is not None:
                deliver(token, "weights", [weights], [0.0])
            else:  # what the error says
                deliver(token, "none", [], [number(_several_weights(output)), *(_other_layout(output) or ())])

        token = listen(module, "hf-old", self.receive, stack)
        hold_recompile(session, stack)  # a model compiled before the capture runs these hooks too
        handles = [module.register_forward_pre_hook(called), module.register_forward_hook(returned)]
        handles += [d.register_forward_pre_hook(dropping) for d in self.undropped.dropouts]
        for handle in handles:
            stack.callback(handle.remove)

    def _enter(self) -> None:
        """Read the inputs of this call's nn.functional.dropout calls, and its per-head weights where it averages
        them (this thread's call only)."""
        self._leave()  # one a forward that raised left on
        self.per_head = None
        if not elsewhere(self.owner):
            self.mode = _DropoutInputs(self.undropped.saw, self._saw_heads if self.averaged else None)
            self.mode.__enter__()

    def _saw_heads(self, weights: torch.Tensor) -> None:
        self.per_head = held(weights)  # (batch, head, query, key)

    def _leave(self) -> None:
        if self.mode is not None:
            mode, self.mode = self.mode, None
            exit_mode(mode, dispatch=False)

    def receive(self, event: str, tensors: list, numbers: list) -> None:
        """What the hooks delivered, outside any compiled graph."""
        if elsewhere(self.owner):
            return  # another thread's forward
        if event == "call":
            self.undropped.clear()
        elif event == "dropout":
            self.undropped.saw(tensors[0], numbers[0])
        elif event == "weights":
            self.after(held(tensors[0]), 0, None, per_head=bool(numbers[0]))
        else:
            self.after(None, int(numbers[0]), numbers[1:])

    def after(self, weights: torch.Tensor | None, several: int, layout, *, per_head: bool = False) -> None:
        """The module returned ``weights`` (its own layout), or none: ``several`` matrices, or ``layout``, their
        shape where they are not one (query, key) matrix. ``per_head``: they are the heads' own, read where the
        module returned their mean."""
        mod = self.site.module
        dropout = _dropout_of(mod, self.undropped.dropouts)  # while training
        try:
            if weights is None:
                raise self._no_weights(mod, several, tuple(int(n) for n in layout or ()))
            weights, dropped = self.readable(mod, weights, dropout)
        except UnsupportedModelError as e:
            if self.strict:
                raise
            if not self.warned:
                self.warned = True
                warn_user(f"{e}; it is not recorded (the model's other attention modules are)")
            return
        if dropped and self._after_dropout(mod, dropout):
            return
        self.record(mod, weights, dropout, dropped, averaged=self.averaged and not per_head)

    def _after_dropout(self, mod, dropout: float) -> bool:
        """True (and said once) where a statistics capture would read weights the module returned after its dropout
        (training) and its dropout's input could not be read: they are no longer the softmax's, so their statistics
        would not be the attention's."""
        if "weights" in self.session.selection.keep:
            return False
        if not self.dropout_warned:
            self.dropout_warned = True
            warn_user(
                f"attention module {self.site.name!r} ({type(mod).__name__}, layer {self.site.layer}) returns its "
                f"weights after its dropout (p={dropout:g}) while training (their rows do not sum to one), and "
                "applies it where attnprobe cannot read its input (inside another function, or nn.functional.dropout "
                "in a compiled graph): their statistics would not be the softmax's, so a statistics capture (the "
                "monitor) does not record it in training mode; its calls in eval mode are recorded"
            )
        return True

    def readable(self, mod, weights: torch.Tensor, dropout: float = 0.0) -> tuple[torch.Tensor, bool]:
        """The returned ``weights`` as ``(batch, head, query, key)``, and whether they are after the module's
        ``dropout`` (training; its dropout module's input replaces them where it explains them: ``_Undropped``);
        UnsupportedModelError naming what is wrong."""
        site = self.site
        where = f"attention module {site.name!r} ({type(mod).__name__}, layer {site.layer})"
        if self.time_first:
            weights = weights.permute(2, 3, 0, 1)  # (query, key, batch, head) -> (batch, head, query, key)
        dropped = bool(dropout) and not self.pre_softmax
        if dropped:  # the softmax's, where the module's dropout shows them
            weights, dropped = self.undropped.undrop(weights, dropout)
        if self.pre_softmax:
            with torch.no_grad():
                weights = nn.functional.softmax(weights, dim=-1)  # (batch, head, query, key)
        if not _probabilities(weights, dropout if dropped else 0.0):
            raise UnsupportedModelError(
                f"{where} returned output_attentions values in [{float(weights.nan_to_num().min()):.3g}, "
                f"{float(weights.nan_to_num().max()):.3g}]: not post-softmax weights, so attnprobe cannot record them "
                "as weights. Exclude the module with layers=[...]"
            )
        if self.declared is not None and weights.shape[1] != self.declared:
            raise UnsupportedModelError(
                f"{where} has {self.declared} heads but returned weights of shape {tuple(weights.shape)}: not laid "
                "out as (batch, head, query, key), so attnprobe cannot read them. Exclude the module with layers=[...]"
            )
        return weights, dropped

    def _no_weights(self, mod, several: int, shape: tuple[int, ...]) -> UnsupportedModelError:
        """Why the module returned no (query, key) weights: ``several`` (two streams), weights of another ``shape``, or
        none."""
        site = self.site
        where = f"attention module {site.name!r} ({type(mod).__name__}, layer {site.layer})"
        if several:
            return UnsupportedModelError(
                f"{where} returned {several} weight matrices for one call (XLNet's two-stream attention, used with "
                "target_mapping); attnprobe records one (query, key) matrix per call. Capture a forward without "
                "target_mapping, or exclude the module with layers=[...]"
            )
        unreadable = f"no adapter can read attention module {site.name!r} ({type(mod).__name__}, layer {site.layer})"
        if shape:
            return UnsupportedModelError(
                f"{unreadable}: it has no attention interface and returned its weights with shape {shape}, not one "
                "(batch, head, query, key) matrix per call (weights per window or mask unit), so attnprobe cannot "
                f"record them. Trace its softmax with capture(model, modules=[...]) naming {site.name!r}, or "
                f"exclude the module with layers=[...] (it is layer {site.layer})"
            )
        return UnsupportedModelError(
            f"{unreadable}: it has no attention interface and returned no attention weights (call the model itself, "
            "which is asked for output_attentions; if its code computes a softmax, trace it with "
            f"capture(model, modules=[...]) naming it, {site.name!r}; or exclude the module with layers=[...]; "
            f"it is layer {site.layer})"
        )

    def record(self, mod, weights: torch.Tensor, dropout: float, dropped: bool, *, averaged: bool = False) -> None:
        site, state = self.site, self.state
        b, heads, q_len, k_len = weights.shape  # (batch, head, query, key)
        if site.num_heads != heads:
            site.num_heads = heads
            site.num_kv_heads = site.num_kv_heads if site.num_kv_heads and heads % site.num_kv_heads == 0 else heads
            self.session.select_site(site)
        kind = call_kind(self.kind, self.probe)
        offset = state.position if state is not None else 0
        if self.time_first and kind == "self":
            offset = k_len - q_len  # keys = the memory, then this call's positions
        if offset is None:  # a cache that cannot say its length
            offset = max(k_len - q_len, 0) if kind == "self" else 0
        dtype = record_dtype(weights.dtype, self.softmax)
        meta: dict = self.meta
        if dtype != weights.dtype:
            meta = {**meta, "softmax_dtype": str(dtype).removeprefix("torch.")}
        if state is not None:
            meta = state.generation_meta(meta)
        called = decoder_expects(state, kind)  # the call's is_decoder overrides the config's
        if called:
            meta = {**meta, "expects": {**meta.get("expects", {}), **called}}
        said = getattr(mod, "is_causal", None)  # the module's own word (GPT-Neo, Falcon); else nothing
        if averaged:  # every head holds their mean (compiled code, where the per-head weights cannot be read)
            meta = {**meta, "heads_averaged": True}
            if not self.averaged_warned:
                self.averaged_warned = True
                warn_user(
                    f"attention module {self.site.name!r} ({type(mod).__name__}) returns the mean of its heads' "
                    "weights as every head's (F.multi_head_attention_forward averages them; pytorch#32590), and "
                    "attnprobe reads them per head in eager code only (not in a compiled graph, nor for unbatched "
                    "input): its records hold that mean in every head (record.meta['heads_averaged']); capture the "
                    "model uncompiled for its heads' own weights"
                )
        self.session.emit(
            site,
            kind=kind,
            weights=weights,
            query_padding=state.query_padding(b, q_len) if state is not None else None,
            backend="eager",
            dtype=dtype,
            weights_source="output_attentions",
            causal=said if isinstance(said, bool) else None,
            dropout=dropout,
            step=state.step if state is not None else None,
            query_offset=offset,
            meta={**meta, "weights_after_dropout": True} if dropped else meta,
        )
