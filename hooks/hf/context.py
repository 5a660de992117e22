"""What surrounds one Hugging Face attention call: its stack, padding, generation step, kind and heads.

A *stack* is the nearest module above an attention module whose forward takes the model inputs
(``input_ids``, ``inputs_embeds``, ``pixel_values``, ...): ``LlamaModel``, ``BertModel``,
``BartDecoder``, ``T5Stack``, ``WhisperEncoder``. Its call carries the 2-D ``attention_mask``
(which query rows are padding) and the generation cache (``past_key_values`` up to transformers 5.23,
``cache`` from 5.24: found by its type, see ``hf_compat``), which numbers generation steps. One pre-hook
per stack that holds a selected attention module reads both; the attention calls read the state.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import ExitStack
from functools import cache

import torch
from torch import nn

from ...probe.threads import current, elsewhere
from ...probe.walk import walk_of
from ..deliver import deliver, listen, number, value_of
from . import compat as hf_compat

#: inputs a stack's call may carry that say what the attention should be (image blocks, packed documents): read with
#: the mask, kept for the call's records (``StackState.input_of``)
DECLARING_INPUTS = ("token_type_ids", "mm_token_type_ids", "position_ids")
INPUT_NAMES = ("input_ids", "inputs_embeds", "input_features", "pixel_values", "input_values", "decoder_input_ids")
CROSS_NAMES = ("key_value_states", "encoder_hidden_states", "cross_attention_states")
#: forwards that take queries and keys separately (fsmt, sam, ...): cross when the keys are another tensor
QUERY_KEY_NAMES = (("query", "key"), ("queries", "keys"), ("query_tensor", "key_tensor"))
HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_heads", "n_head", "num_attn_heads")
KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")


def forward_params(cls: type) -> dict[str, int]:
    """Parameter name -> positional index (after ``self``) of ``cls.forward``; {} when unknown."""
    # the cache sits behind this function: mypy does not take a class object such as type[nn.Module] as Hashable
    return _forward_params(cls)


@cache
def _forward_params(cls: type) -> dict[str, int]:
    forward = getattr(cls, "forward", None)
    if forward is None:
        return {}
    try:
        params = list(inspect.signature(forward).parameters.values())[1:]
    except (TypeError, ValueError):  # a forward inspect cannot read
        return {}
    return {p.name: (i if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) else -1) for i, p in enumerate(params)}


_NO_PARAM = object()  # the default of a parameter the forward does not have


def _default_of(cls: type, name: str):
    """The default of ``cls.forward``'s parameter ``name`` (None where it has none), or ``_NO_PARAM``."""
    return _cached_default(cls, name)  # mypy takes no class object for Hashable (as forward_params)


@cache
def _cached_default(cls: type, name: str):
    forward = getattr(cls, "forward", None)
    try:
        param = inspect.signature(forward).parameters.get(name) if forward is not None else None
    except (TypeError, ValueError):
        return _NO_PARAM
    if param is None:
        return _NO_PARAM
    return None if param.default is inspect.Parameter.empty else param.default


def argument(params: dict[str, int], name: str, args: tuple, kwargs: dict):
    """The value passed for parameter ``name`` (keyword or positional), or None."""
    if name in kwargs:
        return kwargs[name]
    i = params.get(name, -1)
    return args[i] if 0 <= i < len(args) else None


def parents_of(model: nn.Module, named: list | None = None) -> dict[int, nn.Module]:
    """id(child) -> parent for every module under ``model`` (``named``: its ``named_modules()``, if walked already)."""
    return walk_of(model, named).parents


def ancestors(module: nn.Module, parents: dict[int, nn.Module]):
    """The modules above ``module``, nearest first."""
    m = parents.get(id(module))
    while m is not None:
        yield m
        m = parents.get(id(m))


def head_counts(module: nn.Module) -> tuple[int | None, int | None]:
    """(query heads, key/value heads) from the module's attributes or its config; None when unsure.

    Only a hint for validating a head selection early: the first call corrects it from the tensors.
    """
    config = getattr(module, "config", None)
    heads = next((v for a in HEAD_ATTRS if isinstance(v := getattr(module, a, None), int) and v > 0), None)
    if heads is None and config is not None:
        heads = getattr(config, "num_attention_heads", None)
        heads = heads if isinstance(heads, int) and heads > 0 else None
    if heads is None:
        return None, None
    kv = next((v for a in KV_HEAD_ATTRS if isinstance(v := getattr(module, a, None), int) and v > 0), None)
    groups = getattr(module, "num_key_value_groups", None)
    if kv is None and isinstance(groups, int) and groups > 0 and heads % groups == 0:
        kv = heads // groups
    if kv is not None and (kv > heads or heads % kv):
        kv = None  # attributes that do not describe grouped-query attention (JetMoE's per-expert kv heads)
    return heads, kv or heads


def static_kind(module: nn.Module) -> str | None:
    """ "self" or "cross" when the module always does the same; None when each call must tell."""
    flag = getattr(module, "is_cross_attention", None)
    if isinstance(flag, bool):
        return "cross" if flag else "self"
    if "Cross" in type(module).__name__:
        return "cross"
    params = forward_params(type(module))
    per_call = any(n in params for n in CROSS_NAMES) or any(q in params and k in params for q, k in QUERY_KEY_NAMES)
    return None if per_call else "self"


class KindProbe:
    """Reads, before each call of an attention module, whether it attends another sequence."""

    def __init__(self, module: nn.Module, stack: ExitStack) -> None:
        self.kind = "self"
        params = forward_params(type(module))
        self._owner = current()  # made as the capture opens, in its thread; other threads' calls are not read
        token = 0

        def before(module, args, kwargs):  # inside the forward: reads which arguments were given, nothing else
            cross = any(argument(params, n, args, kwargs) is not None for n in CROSS_NAMES)
            for q_name, k_name in QUERY_KEY_NAMES:
                if not cross and q_name in params and k_name in params:
                    key = argument(params, k_name, args, kwargs)
                    cross = key is not None and key is not argument(params, q_name, args, kwargs)
            deliver(token, "kind", [], [number(cross)])

        token = listen(module, "hf-kind", self._receive, stack)
        handle = module.register_forward_pre_hook(before, with_kwargs=True)
        stack.callback(handle.remove)

    def _receive(self, event: str, tensors: list, numbers: list) -> None:
        if not elsewhere(self._owner):
            self.kind = "cross" if numbers[0] else "self"


def is_stack(module: nn.Module) -> bool:
    params = forward_params(type(module))
    return any(n in params for n in INPUT_NAMES)


def padding_from(mask) -> torch.Tensor | None:
    """True where a 2-D Hugging Face attention mask (1 = token, 0 = padding) marks padding."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return None
    if mask.dtype == torch.bool:
        return ~mask
    if not bool(((mask == 0) | (mask == 1)).all()):
        return None  # not a 0/1 padding mask
    return mask == 0


def _built_mask(mask, block_mask: type | None) -> bool:
    """A mask the model built above this stack: 4-D, flex's ``BlockMask`` (the class, or None without flex), or one
    per layer type (Gemma3's multimodal model hands its language model ``{"full_attention": ..., ...}``)."""
    if isinstance(mask, dict):
        return any(_built_mask(m, block_mask) for m in mask.values())
    return (isinstance(mask, torch.Tensor) and mask.dim() > 2) or (
        block_mask is not None and isinstance(mask, block_mask)
    )


def call_kind(static: str | None, probe: KindProbe | None) -> str:
    """Self- or cross-attention, for the call running now: what the module's class says (``static_kind``), else what
    the arguments of this call said (``KindProbe``)."""
    if static is not None:
        return static
    return probe.kind if probe is not None else "self"


class _ReorderWatcher:
    """A cache's ``reorder_cache`` as a stack watches it: marks each watching stack, then runs the cache's own."""

    def __init__(self, method: Callable, first: StackState) -> None:
        self.method = method
        self.attnprobe_watchers = [first]  # the stacks sharing this cache

    def __call__(self, *args, **kwargs):
        for state in self.attnprobe_watchers:
            state._reorder_seen = True
        return self.method(*args, **kwargs)


class StackState:
    """The current call of one stack: padded positions, generation step, position of the first query."""

    def __init__(self, module: nn.Module, stack: ExitStack) -> None:
        self.padding: torch.Tensor | None = None  # (batch, positions) True = padding
        self.inputs: dict[str, torch.Tensor] = {}  # DECLARING_INPUTS this call received, (batch, positions) each
        self.cached = False  # the call runs with a cache (given, or made inside: use_cache, the config's too)
        self.caches = False  # ... given, or made inside where the forward takes use_cache (a decoder's stack)
        self.is_decoder: bool | None = None  # the call's is_decoder, where the forward takes one (BLIP's text model)
        self.cls = type(module)
        self.built_mask = False  # the call received a mask that is no 2-D padding mask (a 4-D one built above)
        self.outer: StackState | None = None  # the next stack above, whose 2-D mask this one's was built from
        self.step: int | None = None
        self.position: int | None = 0  # position of the first query of this call (None: the cache cannot say)
        self._params = forward_params(type(module))
        self._run_cache = None
        self._run_step = 0
        self._cache_type = hf_compat.cache_class()
        self._name = type(module).__name__
        self._config = getattr(module, "config", None)
        self.reordered = False  # beam search reordered the cache's batch rows since the previous step
        self._reorder_seen = False
        self._watched: list = []  # (cache, its own reorder_cache attribute or None, the wrapper)
        self._owner = current()  # made as the capture opens, in its thread; other threads' calls are not read
        params, cache_type = self._params, self._cache_type
        block_mask = hf_compat.block_mask_class()  # read here, not inside the forward (traced by torch.compile)
        decoder_default = _default_of(type(module), "is_decoder")
        token = 0

        # inside the forward: hand over the mask and the cache, nothing else (traceable by torch.compile)
        def before(module, args, kwargs):
            mask = argument(params, "attention_mask", args, kwargs)
            cache = hf_compat.find_cache(args, kwargs, cache_type)
            unknown = None
            for value in (*kwargs.values(), *args) if cache is None else ():
                if hf_compat.looks_like_cache(value):  # a loop, not next(..., None): torch 2.6's Dynamo cannot trace it
                    unknown = value
                    break
            compiling = torch.compiler.is_compiling()  # a compiled graph hands over tensors only
            declaring = [argument(params, n, args, kwargs) for n in DECLARING_INPUTS]
            use_cache = argument(params, "use_cache", args, kwargs)
            is_decoder = argument(params, "is_decoder", args, kwargs) if decoder_default is not _NO_PARAM else None
            is_decoder = decoder_default if is_decoder is None else is_decoder
            deliver(
                token,
                "before",
                [
                    mask if isinstance(mask, torch.Tensor) else None,
                    None if compiling else cache,
                    None if compiling else unknown,
                    *(t if isinstance(t, torch.Tensor) else None for t in declaring),
                ],
                [
                    number(_built_mask(mask, block_mask)),
                    number(cache is not None),
                    number(unknown is not None),
                    number(use_cache if isinstance(use_cache, bool) else None),
                    number(is_decoder if isinstance(is_decoder, bool) else None),
                ],
            )

        def after(module, args, output):
            deliver(token, "after", [], [])

        token = listen(module, "hf-stack", self._receive, stack)
        for handle in (
            module.register_forward_pre_hook(before, with_kwargs=True),
            # not always_call (Dynamo guards on those hooks' ids): after a forward that raised, the next call of
            # the stack sets the state afresh
            module.register_forward_hook(after),
        ):
            stack.callback(handle.remove)
        stack.callback(self._forget)

    def _receive(self, event: str, tensors: list, numbers: list) -> None:
        if elsewhere(self._owner):
            return
        if event == "before":
            mask, cache, unknown, *declaring = tensors
            self.inputs = {n: t for n, t in zip(DECLARING_INPUTS, declaring) if isinstance(t, torch.Tensor)}
            use_cache = value_of(numbers[3])
            decoder = value_of(numbers[4])
            self.is_decoder = None if decoder is None else bool(decoder)
            configured = bool(getattr(self._config, "use_cache", False))
            self.cached = bool(numbers[1]) or (configured if use_cache is None else bool(use_cache))
            # the config's use_cache counts where this forward takes one (BERT-style encoders' configs say True)
            self.caches = bool(numbers[1]) or (
                configured and "use_cache" in self._params if use_cache is None else bool(use_cache)
            )
            self._before(
                mask, cache, unknown, built=bool(numbers[0]), has_cache=bool(numbers[1]), has_unknown=bool(numbers[2])
            )
        else:
            self._after()

    def _before(self, mask, cache, unknown, *, built: bool, has_cache: bool, has_unknown: bool) -> None:
        self.padding = padding_from(mask)
        self.built_mask = self.padding is None and built
        if has_cache and cache is None:  # a compiled graph: the cache object stays inside it
            self.step, self.position = None, None  # the queries are the last positions of the keys
            return
        if cache is not None:
            # generate() passes one cache object to every step: a new object starts a new run
            if cache is self._run_cache:
                self._run_step += 1
            else:
                self._unwatch()  # the previous run's cache: let it go
                self._run_cache, self._run_step, self._reorder_seen = cache, 0, False
                self._watch_reorder(cache)
            self.step = self._run_step
            self.reordered, self._reorder_seen = self._reorder_seen, False
            self.position = hf_compat.cached_length(cache)
        else:
            self.step, self.position = None, 0
            if has_unknown:
                kind = "cache object" if unknown is None else type(unknown).__name__
                hf_compat.warn_unrecognised(
                    ("cache", kind),
                    f"{self._name}.forward received a {kind}, which attnprobe does not recognise "
                    "as a generation cache (no transformers.cache_utils.Cache): generation steps are not recorded "
                    "(records have step=None) and query positions are read from the key and query lengths",
                )
                self.position = None  # the queries are the last positions of the keys

    def _after(self) -> None:
        # a module called on its own later must not see this call's state
        self.padding, self.step, self.position, self.built_mask, self.reordered = None, None, 0, False, False
        self.inputs, self.cached, self.caches, self.is_decoder = {}, False, False, None

    def decoder_of(self) -> tuple[bool, StackState] | None:
        """``(is_decoder, the stack that received it)``: the ``is_decoder`` argument of this call, or of the nearest
        stack above whose forward takes one (BLIP's text model: the config's ``is_decoder`` is only its default)."""
        state: StackState | None = self
        while state is not None:
            if state.is_decoder is not None:
                return state.is_decoder, state
            state = state.outer
        return None

    def input_of(self, name: str) -> tuple[torch.Tensor, StackState] | None:
        """``(tensor, the stack that received it)``: input ``name`` (one of ``DECLARING_INPUTS``) of this call, or of
        the nearest stack above that received it (Gemma 3's language model gets its token_type_ids from the model)."""
        state: StackState | None = self
        while state is not None:
            t = state.inputs.get(name)
            if t is not None:
                return t, state
            state = state.outer
        return None

    @property
    def config(self):
        """The stack module's config (None without one)."""
        return self._config

    def _watch_reorder(self, cache) -> None:
        """Note when beam search reorders ``cache``'s batch rows (``generate`` calls ``reorder_cache`` between
        steps): the rows of later steps then continue other rows' histories. The cache's own method runs as
        before; the capture's exit removes the wrapper. Stacks that share a cache (an encoder-decoder's
        decoder inside its model) share one wrapper."""
        if not hasattr(cache, "__dict__"):  # a cache with __slots__ takes no wrapper: beam steps stay unmarked
            return
        own = cache.__dict__.get("reorder_cache")
        watchers = getattr(own, "attnprobe_watchers", None)
        if watchers is not None:
            if self not in watchers:
                watchers.append(self)
            return
        method = getattr(cache, "reorder_cache", None)
        if not callable(method):
            return
        wrapper = _ReorderWatcher(method, self)
        self._watched.append((cache, own, wrapper))
        cache.reorder_cache = wrapper

    def generation_meta(self, meta: dict) -> dict:
        """``meta`` plus ``reordered_rows`` when beam search reordered the rows before this step."""
        return {**meta, "reordered_rows": True} if self.reordered and self.step is not None else meta

    def _unwatch(self) -> None:
        for watched, own, wrapper in reversed(self._watched):
            if watched.__dict__.get("reorder_cache") is wrapper:
                if own is None:
                    del watched.reorder_cache
                else:
                    watched.reorder_cache = own
        self._watched.clear()

    def _forget(self) -> None:
        self._unwatch()
        self._run_cache = None
        self.padding = None

    def left_padding(self, batch: int) -> list[int] | None:
        """Each row's padded positions before its first token, by the stack's mask (None where it has none or it is
        no padding mask of this batch): where transformers starts a row's chunks (``chunked_overlay``)."""
        p = self.padding
        if p is None and self.built_mask and self.outer is not None:
            return self.outer.left_padding(batch)
        if p is None or p.shape[0] != batch:
            return None
        return p.long().cumprod(-1).sum(-1).tolist()

    def query_padding(self, batch: int, q_len: int) -> torch.Tensor | None:
        """(batch, query) True for padded query rows of a call with ``q_len`` queries.

        The stack's mask covers the cached positions and this call's queries, so its length must be
        exactly ``position + q_len``. Anything else is a mask over other positions (speech models
        take a mask over audio samples, which the feature encoder downsamples into frames) and says
        nothing about the query rows: None then, never a guess.
        """
        p = self.padding
        if p is None and self.built_mask and self.outer is not None:
            # an inner stack (CLIPEncoder) handed the 4-D mask its model built from the 2-D one
            return self.outer.query_padding(batch, q_len)
        if p is None or p.shape[0] != batch:
            return None
        if self.position is None:  # a cache that cannot say its length: the queries are the last positions
            return p[:, p.shape[1] - q_len :] if p.shape[1] >= q_len else None
        if p.shape[1] != self.position + q_len:
            return None
        return p[:, self.position :]


class Surroundings:
    """Per capture: the stacks above the selected attention modules and the encoder/decoder split."""

    def __init__(self, model: nn.Module, stack: ExitStack, named: list | None = None) -> None:
        self._stack = stack
        walk = walk_of(model, named)  # the capture's walk of the model, or a new one
        self.parents = walk.parents
        self._states: dict[int, StackState] = {}
        self._encoder_ids, self._decoder_ids = _encoder_decoder_ids(model, walk)

    def stack_of(self, module: nn.Module) -> StackState | None:
        """The state of the nearest stack above ``module``, linked to the stacks above it."""
        for above in ancestors(module, self.parents):
            if is_stack(above):
                state = self._states.get(id(above))
                if state is None:
                    state = self._states[id(above)] = StackState(above, self._stack)
                    state.outer = self.stack_of(above)
                return state
        return None

    def part_of(self, module: nn.Module) -> str | None:
        """ "encoder" or "decoder" inside an encoder-decoder model, else None."""
        if id(module) in self._encoder_ids:
            return "encoder"
        if id(module) in self._decoder_ids:
            return "decoder"
        return None


def _encoder_decoder_ids(model: nn.Module, named: list | None = None) -> tuple[set[int], set[int]]:
    encoder, decoder = set(), set()
    plain: set[int] = set()  # ids of configs that are no encoder-decoder (a model's layers share one config)
    walk = walk_of(model, named)
    for m, config in walk.configs:
        if id(config) in plain:
            continue
        if not getattr(config, "is_encoder_decoder", False):
            plain.add(id(config))
            continue
        get_encoder = getattr(m, "get_encoder", None)
        if get_encoder is None:
            continue
        try:
            enc = get_encoder()
        except Exception:
            continue
        if not isinstance(enc, nn.Module) or enc is m:
            continue
        inside = {id(x) for x in enc.modules()}
        encoder |= inside
        below = {id(x) for _, x in walk} if m is model else {id(x) for x in m.modules()}
        decoder |= below - inside - encoder
    return encoder, decoder
