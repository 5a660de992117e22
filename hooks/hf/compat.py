"""Everything attnprobe relies on in ``transformers`` beyond its documented API, in one place.

transformers releases often and moves internals: 5.24 renamed the models' forward argument
``past_key_values`` to ``cache`` and moved gptj, codegen and layoutlmv3 onto the attention interface.
Each item below says what attnprobe uses, which releases behave how (checked by running code on the
releases CI installs: the oldest declared, 5.16, the latest patch of every minor release after it, and the
newest; the ranges that name 5.0 were read on 5.0 before 5.16 became the oldest declared), and what happens
when a release no longer matches. Where a name can be avoided it is: the cache is found among a call's arguments by
its type, never by its keyword. When something is not recognised attnprobe warns once, naming the
installed release (``warn_unrecognised``), instead of writing records that look complete.

The other modules of ``hooks/`` reach transformers through these functions (a few public names, such
as ``AutoModel`` or ``PreTrainedModel``, are imported where they are used).

Items, by where they are used:

Attention dispatch (hooks/hf/adapter.py)
  1. Interface modules call ``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, <the file's
     own eager function>)`` (5.1-5.24); 5.0 wrote the same dispatch as ``if config._attn_implementation !=
     "eager": attention_interface = ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`` (hf.py lets that one
     comparison with "eager" through: it is the dispatch). A forward whose code names ``ALL_ATTENTION_FUNCTIONS``
     uses the interface (5.0-5.24). Which families do changes between releases (gptj, codegen, layoutlmv3:
     old-style up to 5.23, interface from 5.24): read from the installed code, never from a list.
  2. The eager default is the modeling file's own ``*eager_attention_forward`` global (5.0-5.24; "eager" is
     not in the registry).
  3. ``AttentionInterface._global_mapping`` and ``AttentionMaskInterface._global_mapping``: the registries'
     private dicts, read to restore them exactly and to see what a name maps to (5.0-5.24).
     ``AttentionInterface.register`` / ``AttentionMaskInterface.register`` are public.
  4. ``masking_utils.sdpa_mask`` / ``eager_mask`` (readable masks), ``flash_attention_mask`` /
     ``flex_attention_mask`` (not (query, key) masks) (5.0-5.24).
  5. ``integrations.sdpa_attention.sdpa_attention_forward``: the sdpa function (5.0-5.24).
  6. ``config._attn_implementation`` (read) and ``config._attn_implementation_internal`` (written for the
     length of a capture, then restored), ``config.sub_configs`` (5.0-5.24).
  7. GPT-2's ``_upcast_and_reordered_attn`` / ``reorder_and_upcast_attn`` eager path (5.0-5.24).
  8. Keyword arguments of attention calls: ``scaling``, ``dropout``, ``is_causal``, ``position_bias`` (T5),
     ``softcap`` (Gemma2), ``s_aux`` (GPT-OSS sinks), ``sliding_window`` (5.0-5.24).
Surroundings of a call (hooks/hf/context.py)
  9. The generation cache reaches the model stacks as an instance of ``cache_utils.Cache``: keyword
     ``past_key_values`` up to 5.23, ``cache`` from 5.24 (``past_key_values`` still accepted by the top-level
     model with a FutureWarning until its removal). attnprobe finds it by type among all arguments.
 10. ``Cache.get_seq_length(layer)``, ``Cache.layers`` and ``Cache.reorder_cache`` (beam search) (5.0-5.24).
 11. A stack's forward takes ``attention_mask`` (2-D, 1 = token) and one of the input names in
     ``hf_context.INPUT_NAMES`` (5.0-5.24).
Old-style models (hooks/hf/fallback.py)
 12. ``PreTrainedModel._can_set_attn_implementation()`` is False for models without the interface (5.0-5.24);
     their ``output_attentions=True`` returns the weights.
"""

from __future__ import annotations

import functools

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


# ------------------------------------------------------------------------------- generation cache (9, 10)
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


def looks_like_cache(value) -> bool:
    """An argument that is probably a cache attnprobe did not recognise (a class named ``*Cache*``)."""
    return value is not None and "Cache" in type(value).__name__


def cached_length(cache) -> int | None:
    """Tokens already in the cache (the position of the next query); None when the cache cannot say.

    Hybrid caches (Mamba + attention) refuse ``get_seq_length()`` on a layer without attention.
    """
    for layer in range(max(len(getattr(cache, "layers", ())), 1)):
        try:
            return int(cache.get_seq_length(layer))
        except (ValueError, IndexError, TypeError, AttributeError):
            continue
    return None


# ------------------------------------------------------------------------------- registries (3, 4, 5)
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


def register_attention(name: str, fn) -> None:
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(name, fn)


def register_mask(name: str, fn) -> None:
    from transformers.masking_utils import AttentionMaskInterface

    AttentionMaskInterface.register(name, fn)


def mask_functions() -> tuple:
    """(eager_mask, sdpa_mask, {mask functions whose result is no (query, key) mask})."""
    from transformers import masking_utils

    unreadable = {getattr(masking_utils, n, None) for n in ("flash_attention_mask", "flex_attention_mask")}
    unreadable.discard(None)
    return masking_utils.eager_mask, masking_utils.sdpa_mask, unreadable


def sdpa_forward():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


# ------------------------------------------------------------------------------------------ configs (6)
def config_class() -> type:
    from transformers import PretrainedConfig

    return PretrainedConfig


def implementation_internal(config):
    """What to restore on exit: the config's own attribute (``_attn_implementation_internal``)."""
    return getattr(config, "_attn_implementation_internal", getattr(config, "_attn_implementation", None))


def set_implementation_internal(config, name) -> None:
    """Point one config (not its sub-configs) at ``name`` without the checks of ``set_attn_implementation``."""
    config._attn_implementation_internal = name


# ----------------------------------------------------------------------------------- old-style (12)
def pretrained_model_class() -> type:
    from transformers import PreTrainedModel

    return PreTrainedModel


def can_set_implementation(cls: type) -> bool | None:
    """``cls._can_set_attn_implementation()``: False for models without the attention interface; None if unknown."""
    can_set = getattr(cls, "_can_set_attn_implementation", None)
    if can_set is None:
        return None
    return bool(can_set())
