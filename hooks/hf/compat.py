"""Everything attnprobe relies on in ``transformers`` beyond its documented API, in one place.

transformers releases often and moves internals: 5.24 renamed the models' forward argument
``past_key_values`` to ``cache`` and moved gptj, codegen and layoutlmv3 onto the attention interface.
Each item below says what attnprobe uses, which releases behave how (checked by running code on the
releases CI installs: the oldest declared, the latest patch of every minor release after it, and the newest;
the ranges that name 5.0 were read on 5.0, those from 5.16 on 5.16 to 5.24, while CI tested them; the range
declared today is 5.24 and later, see pyproject.toml), and what happens when a release no longer matches.
Where a name can be avoided it is: the cache is found among a call's arguments by
its type, never by its keyword. When something is not recognised attnprobe warns once, naming the
installed release (``warn_unrecognised``), instead of writing records that look complete.

The other modules of ``hooks/`` reach transformers through these functions (a few public names, such
as ``AutoModel`` or ``PreTrainedModel``, are imported where they are used).

Items, by where they are used:

Attention dispatch (hooks/hf/dispatch.py)
  1. Interface modules call ``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, <the file's
     own eager function>)`` (5.1-5.24); 5.0 wrote the same dispatch as ``if config._attn_implementation !=
     "eager": attention_interface = ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``. A forward whose code
     names ``ALL_ATTENTION_FUNCTIONS`` uses the interface (5.0-5.24). Which families do changes between releases
     (gptj, codegen, layoutlmv3: old-style up to 5.23, interface from 5.24): read from the installed code, never
     from a list. ``get_interface`` drops a ``paged|`` prefix but for ``paged|eager`` (5.16-5.24).
  2. The eager default is the modeling file's own ``*eager_attention_forward`` global, looked up when the forward
     runs (5.0-5.24; "eager" is not in the registry): a capture wraps that global in place.
  3. ``AttentionInterface._global_mapping`` and a file-local interface's ``_local_mapping``: the dicts the
     dispatch reads (``GeneralInterface.__getitem__``, 5.0-5.24); a capture wraps the entry in place and puts the
     function back when it closes. ``AttentionMaskInterface._global_mapping``: the mask function of a name.
  4. ``masking_utils.sdpa_mask`` / ``eager_mask`` (readable masks), ``flash_attention_mask`` (a 2-D padding mask
     or None) / ``flex_attention_mask`` (a ``BlockMask``) (5.0-5.24).
  5. ``integrations.sdpa_attention.sdpa_attention_forward``, ``integrations.flex_attention.flex_attention_forward``
     and ``integrations.flash_attention.flash_attention_forward``: the functions whose math attnprobe knows; hub
     flash kernels register ``flash_attention_forward`` under their own name (``hub_kernels``, 5.0-5.24).
  6. ``config._attn_implementation`` (read, never written), ``config.sub_configs`` (5.0-5.24).
  7. GPT-2's ``_upcast_and_reordered_attn`` / ``reorder_and_upcast_attn`` eager path, called instead of the
     interface when the flag is set (5.0-5.24).
  8. Keyword arguments of attention calls: ``scaling``, ``dropout``, ``is_causal``, ``position_bias`` (T5),
     ``softcap`` (Gemma2), ``s_aux`` (GPT-OSS sinks), ``sliding_window``, ``position_ids`` and ``cu_seq_lens_q/k``
     (flash's varlen) (5.0-5.24).
  9. Flash semantics (``modeling_flash_attention_utils._flash_attention_forward``): a 2-D padding mask unpads (the
     queries are the last ``query_length`` positions of the mask), else ``cu_seq_lens_q/k`` given, else packed
     ``position_ids`` (batch 1, documents start where the position is the minimum), else the plain kernel; causal
     bottom-right aligned unless ``flash_attention._use_top_left_mask``; ``window_size=(w - 1, w - 1)`` when the
     keys outnumber ``sliding_window`` (5.0-5.24).
Surroundings of a call (hooks/hf/context.py)
 10. The generation cache reaches the model stacks as an instance of ``cache_utils.Cache``: keyword
     ``past_key_values`` up to 5.23, ``cache`` from 5.24 (``past_key_values`` still accepted by the top-level
     model with a FutureWarning until its removal). attnprobe finds it by type among all arguments.
 11. ``Cache.get_seq_length(layer)``, ``Cache.layers`` and ``Cache.reorder_cache`` (beam search) (5.0-5.24).
 12. A stack's forward takes ``attention_mask`` (2-D, 1 = token) and one of the input names in
     ``hf_context.INPUT_NAMES`` (5.0-5.24).
Old-style models (hooks/hf/fallback.py)
 13. ``PreTrainedModel._can_set_attn_implementation()`` is False for models without the interface (5.0-5.24);
     their ``output_attentions=True`` returns the weights.
"""

from __future__ import annotations

import functools

import torch

from ...probe.errors import warn_user

_WARNED: set = set()


@functools.cache
def version() -> str:
    """The installed transformers release, e.g. ``"5.24.0"``."""
    import transformers

    return str(getattr(transformers, "__version__", "unknown"))


@functools.cache
def version_tuple() -> tuple[int, ...]:
    parts = []
    for piece in version().split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def warn_unrecognised(key, what: str) -> None:
    """Warn once per ``key`` that transformers did something attnprobe does not recognise, naming the release."""
    if key in _WARNED:
        return
    _WARNED.add(key)
    warn_user(
        f"transformers {version()}: {what}. This release may have changed something attnprobe relies on "
        "(see attnprobe/hooks/hf_compat.py); please report it with your transformers version"
    )


# ------------------------------------------------------------------------------ generation cache (10, 11)
def cache_class() -> type | None:
    """The base class of every generation cache (``transformers.cache_utils.Cache``); None if it is gone."""
    try:
        from transformers.cache_utils import Cache
    except ImportError:
        return None
    return Cache


def cache_argument_name() -> str:
    """The keyword under which models take a cache in the installed release (for messages and examples)."""
    return "cache" if version_tuple() >= (5, 24) else "past_key_values"


def find_cache(args: tuple, kwargs: dict, cache_type: type | None):
    """The generation cache among a call's arguments, found by its type (whatever its keyword); else None."""
    if cache_type is None:
        return None
    for value in (*kwargs.values(), *args):
        if isinstance(value, cache_type):
            return value
    return None


#: arguments that are never a cache; torch 2.6's Dynamo cannot read the class name of a builtin value
_PLAIN = (bool, int, float, str, tuple, list, dict, torch.Tensor)


def looks_like_cache(value) -> bool:
    """An argument that is probably a cache attnprobe did not recognise (a class named ``*Cache*``)."""
    return value is not None and not isinstance(value, _PLAIN) and "Cache" in type(value).__name__


def cached_length(cache) -> int | None:
    """Tokens already in the cache (the position of the next query); None when the cache cannot say.

    Hybrid caches refuse ``get_seq_length()`` on a layer without attention (Mamba), or say 0 there (MiniMax's
    lightning attention layers): the first layer that says more than 0, else 0 where one said 0.
    """
    found = None
    for layer in range(max(len(getattr(cache, "layers", ())), 1)):
        try:
            n = int(cache.get_seq_length(layer))
        except (ValueError, IndexError, TypeError, AttributeError):
            continue
        if n:
            return n
        found = 0
    return found


# --------------------------------------------------------------------------- registries, functions (3, 4, 5, 9)
def attention_registry() -> dict:
    """name -> attention function (``AttentionInterface._global_mapping``)."""
    from transformers.modeling_utils import AttentionInterface

    return _mapping(AttentionInterface, "AttentionInterface")


def mask_registry() -> dict:
    """name -> mask function (``AttentionMaskInterface._global_mapping``)."""
    from transformers.masking_utils import AttentionMaskInterface

    return _mapping(AttentionMaskInterface, "AttentionMaskInterface")


def _mapping(interface: type, name: str) -> dict:
    mapping = getattr(interface, "_global_mapping", None)
    if not isinstance(mapping, dict):
        from ...probe.errors import UnsupportedModelError

        raise UnsupportedModelError(
            f"transformers {version()}: {name} keeps no `_global_mapping` dict, which attnprobe reads to wrap a "
            "model's attention function and restore the registry afterwards; this release is not supported "
            "(install a transformers release attnprobe declares, see its pyproject.toml)"
        )
    return mapping


def mask_functions() -> tuple:
    """(eager_mask, sdpa_mask, {mask functions whose result is no (query, key) mask})."""
    from transformers import masking_utils

    unreadable = {getattr(masking_utils, n, None) for n in ("flash_attention_mask", "flex_attention_mask")}
    unreadable.discard(None)
    return masking_utils.eager_mask, masking_utils.sdpa_mask, unreadable


def sdpa_forward():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


@functools.cache
def kernel_functions() -> dict:
    """transformers' own attention functions whose math attnprobe knows -> "sdpa", "flex" or "flash" (item 5)."""
    found: dict = {sdpa_forward(): "sdpa"}
    try:
        from transformers.integrations.flex_attention import flex_attention_forward

        found[flex_attention_forward] = "flex"
    except ImportError:  # a torch without flex attention
        pass
    from transformers.integrations.flash_attention import flash_attention_forward

    found[flash_attention_forward] = "flash"
    return found


def flash_top_left() -> bool:
    """Whether transformers' flash path aligns causal masks to the upper left (flash-attn before 2.1, some NPUs),
    rather than to the lower right (item 9)."""
    from transformers.integrations import flash_attention

    return bool(getattr(flash_attention, "_use_top_left_mask", False))


def flash_takes_sinks() -> bool:
    """Whether the flash functions transformers loaded take sink logits (``s_aux``, FA3 from vLLM; ``learnable_sink``,
    FA4): transformers drops ``s_aux`` for the others (item 9)."""
    import inspect

    from transformers import modeling_flash_attention_utils as fa

    fn = getattr(fa, "_flash_varlen_fn", None) or getattr(fa, "_flash_fn", None)
    try:
        params = inspect.signature(fn).parameters if fn is not None else {}
    except (TypeError, ValueError):
        return False
    return "s_aux" in params or "learnable_sink" in params


def block_mask_class() -> type | None:
    """torch's flex ``BlockMask``; None when the installed torch has no flex attention."""
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError:
        return None
    return BlockMask


# ------------------------------------------------------------------------------------------ old-style (13)
def pretrained_model_class() -> type:
    from transformers import PreTrainedModel

    return PreTrainedModel


def can_set_implementation(cls: type) -> bool | None:
    """``cls._can_set_attn_implementation()``: False for models without the attention interface; None if unknown."""
    can_set = getattr(cls, "_can_set_attn_implementation", None)
    if can_set is None:
        return None
    return bool(can_set())
