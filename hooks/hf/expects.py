"""What a Hugging Face model declares about its attention, read from its config and inputs: ``record.meta["expects"]``.

``check`` holds every record to these unasked, naming the source (``CheckResult.declarations``); a user's
declaration of the same name replaces them (see ``probe/checks/predicate.py`` for the names and meanings):

- ``causal``: False for the self-attention of an encoder-decoder's encoder and for
  ``use_bidirectional_attention`` (True, or ``"all"``); True for ``is_decoder=True`` outside an encoder-decoder
  (RoFormer, BigBird, RemBert, MegatronBert as causal LMs, transformers #48745);
- ``sliding_window`` / ``chunk_size``: a layer's ``layer_types`` entry (``"sliding_attention"``,
  ``"chunked_attention"``) with the config's ``sliding_window`` / ``attention_chunk_size``; without layer types a
  decoder's ``sliding_window`` (Mistral) unless ``use_sliding_window`` is False. Bidirectional sliding layers see
  the window on both sides (``window_ahead``), as Gemma 3 builds them;
- ``bidirectional``: image blocks from the inputs, where the model's mask reads them: Gemma 3's ``token_type_ids``
  (each run of 1s), PaliGemma's prefix (``token_type_ids == 0``), Gemma 4's ``mm_token_type_ids`` on sliding
  layers with ``use_bidirectional_attention="vision"``;
- ``documents``: packed sequences, where the ``position_ids`` the model received restart and no cache is used
  (transformers' ``find_packed_sequence_indices``; with an all-ones 2-D mask too, as transformers #46634 fixes);
- ``scale``: the module's own ``scaling`` attribute, where the projections' outputs were measured
  (``meta["projection_scale"]``: the factor q and k got between their projections and the kernel).

The projections are read by forward hooks on ``q_proj``/``k_proj`` (or ``query``/``key``, ``q``/``k``,
``q_lin``/``k_lin``; ``q_norm``/``k_norm`` where the module normalises them), not on compiled models.
"""

from __future__ import annotations

import math
from contextlib import ExitStack

import torch
from torch import nn

from ...probe.checks.predicate import documents_from_positions
from ..deliver import deliver, held, listen
from .context import forward_params

#: (q, k) submodule names, in the order looked for; a norm after the projection is what q and k come from
PROJECTIONS = (("q_norm", "k_norm"), ("q_proj", "k_proj"), ("query", "key"), ("q_lin", "k_lin"), ("q", "k"))


def _entry(value, source: str) -> dict:
    return {"value": value, "source": source}


def _causal(module: nn.Module, config, part: str | None) -> dict | None:
    cls = type(config).__name__
    if getattr(config, "is_causal", None) is False:  # transformers' masks follow it (create_causal_mask)
        return _entry(False, f"{cls}.is_causal=False")
    bidirectional = getattr(config, "use_bidirectional_attention", None)
    family = type(module).__module__.split(".")[-1]
    if (bidirectional is True and family in _BIDIRECTIONAL_WINDOWS) or bidirectional == "all":
        return _entry(False, f"{cls}.use_bidirectional_attention={bidirectional!r}")
    if part == "encoder":
        return _entry(False, f"the encoder of an encoder-decoder ({type(module).__name__})")
    decoder = getattr(config, "is_decoder", False) is True and not getattr(config, "is_encoder_decoder", False)
    if decoder and part is None and not getattr(config, "add_cross_attention", False):
        return _entry(True, f"{cls}.is_decoder=True")
    return None


def _windows(module: nn.Module, config, causal: dict | None) -> dict:
    """``sliding_window`` (and ``window_ahead`` on bidirectional layers) or ``chunk_size`` of this layer."""
    cls, layer = type(config).__name__, getattr(module, "layer_idx", None)
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    kind = None
    if isinstance(types, (list, tuple)) and isinstance(layer, int) and 0 <= layer < len(types):
        kind = types[layer]
        where = f"{cls}.layer_types[{layer}]={kind!r}"
    elif types is None and getattr(config, "use_sliding_window", True) is not False:
        kind, where = ("sliding_attention", f"{cls} (no layer_types)") if window else (None, "")
    if kind == "chunked_attention" and isinstance(getattr(config, "attention_chunk_size", None), int):
        return {
            "chunk_size": _entry(
                config.attention_chunk_size, f"{where}, attention_chunk_size={config.attention_chunk_size}"
            )
        }
    if kind != "sliding_attention" or not isinstance(window, int) or window < 1:
        return {}
    out = {"sliding_window": _entry(window, f"{where}, sliding_window={window}")}
    is_causal = causal["value"] if causal is not None else getattr(module, "is_causal", None)
    if is_causal is True:
        return out
    if is_causal is False and type(module).__module__.split(".")[-1] in _BIDIRECTIONAL_WINDOWS:
        out["window_ahead"] = _entry(window, f"{where}: |q - kv| < {window} on a bidirectional layer")
        return out
    return {}  # a window of a layer not known causal, or of a family whose bidirectional window is its own


#: modeling files whose bidirectional sliding layers see ``|q - kv| < sliding_window`` (Gemma 3's
#: ``_bidirectional_window_overlay``, with the config's halved window)
_BIDIRECTIONAL_WINDOWS = ("modeling_gemma3", "modeling_embedding_gemma2", "modeling_gemma3n")


def config_expects(module: nn.Module, part: str | None, config=None) -> dict:
    """What ``module``'s config (else ``config``, its model's) declares about its self-attention (read once per
    module)."""
    config = getattr(module, "config", None) or config
    if config is None:
        return {}
    out: dict = {}
    causal = _causal(module, config, part)
    if causal is not None:
        out["causal"] = causal
    out.update(_windows(module, config, causal))
    return out


def _blocks_from_inputs(state, module: nn.Module) -> dict:
    """Image blocks the model's own mask reads from its inputs (see the module docstring), as block ids."""
    if state is None:
        return {}
    config = getattr(module, "config", None)
    for name, family, pick in _BLOCK_INPUTS:
        found = state.input_of(name)
        if found is None or family not in found[1].cls.__module__ or not _same_text(module, found[1]):
            continue
        ids, cls = found[0], found[1].cls
        if family == "gemma4" and (
            getattr(config, "use_bidirectional_attention", None) != "vision" or not _sliding(module, config)
        ):
            return {}
        blocks = pick(ids).long()  # (batch, positions): 1 in a block, 0 elsewhere
        if bool(blocks.any()):
            source = f"{name} passed to {cls.__name__}"
            # the model's mask is causal with those blocks opened, whatever its modules' is_causal says
            causal = _entry(True, f"{cls.__name__}'s mask: causal, with the blocks of its {name}")
            return {"bidirectional": _entry(blocks, source), "causal": causal}
    return {}


def _same_text(module: nn.Module, stack) -> bool:
    """Whether ``module`` reads the text the stack's inputs describe: its config is the stack's own or the stack's
    text config (not a vision or audio tower's)."""
    config, theirs = getattr(module, "config", None), getattr(stack, "config", None)
    if config is None or theirs is None:
        return False
    if config is theirs:  # the usual case, read on every layer of every decoding step: no text config looked up
        return True
    return hasattr(theirs, "get_text_config") and config is theirs.get_text_config()


def _sliding(module: nn.Module, config) -> bool:
    types, layer = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    return isinstance(types, (list, tuple)) and isinstance(layer, int) and types[layer] == "sliding_attention"


_BLOCK_INPUTS = (
    ("token_type_ids", "models.gemma3.", lambda t: t == 1),
    ("token_type_ids", "models.paligemma.", lambda t: t == 0),
    ("mm_token_type_ids", "models.gemma4.", lambda t: (t == 1) | (t == 2)),
)


def text_decoder_expects(state, part: str | None) -> dict:
    """``causal=True`` for the self-attention of an encoder-decoder's text decoder (the stack it runs in takes
    ``input_ids``): autoregressive, whatever its modules set (FSMT's, ProphetNet's and MVP's set nothing). DETR-style
    decoders, whose object queries attend each other (``inputs_embeds`` only), are not."""
    if part != "decoder" or state is None or "input_ids" not in forward_params(state.cls):
        return {}
    return {"causal": _entry(True, f"the text decoder of an encoder-decoder ({state.cls.__name__} takes input_ids)")}


def decoder_expects(state, kind: str) -> dict:
    """``causal`` from the ``is_decoder`` argument of this call's stack, where its forward takes one (BLIP's text
    model runs bidirectionally unless called with ``is_decoder=True``, whatever its config's ``is_decoder``)."""
    decoder = state.decoder_of() if state is not None and kind == "self" else None
    if decoder is None:
        return {}
    return {"causal": _entry(decoder[0], f"{decoder[1].cls.__name__}.forward(is_decoder={decoder[0]})")}


def inputs_expects(state, module: nn.Module, kind: str) -> tuple[dict, dict]:
    """``(expects, inputs)`` of one call: image blocks and packed documents from the inputs, and the inputs kept for
    ``check(documents="position_ids")`` (``meta["inputs"]``)."""
    if state is None or kind != "self":
        return {}, {}
    inputs: dict = {}
    expects = {**_blocks_from_inputs(state, module), **decoder_expects(state, kind)}
    found = state.input_of("position_ids")
    if found is not None and found[0].dim() == 2 and _same_text(module, found[1]):
        inputs["position_ids"] = found[0].detach()
        # packed documents are read without a cache only (a decoding step's position ids continue the cache's)
        docs = None if found[1].cached else documents_from_positions({"inputs": inputs})
        if docs is not None and bool((docs[:, -1] > 0).any()):
            expects["documents"] = _entry(
                docs, f"position_ids passed to {found[1].cls.__name__} restart (packed sequences, no cache)"
            )
    return expects, inputs


def scale_expects(module: nn.Module, measured: dict, head_dim: int) -> dict:
    """The scales a module that multiplied q or k after their projections may mean (its ``scaling`` attribute,
    ``head_dim ** -0.5``, Gemma's ``query_pre_attn_scalar ** -0.5``): declared where such a factor was measured, so
    that a pre-scaled q scaled again by the kernel (OPT, transformers #38277) shows. Without a factor the effective
    scale is the kernel's own, which the module passed on purpose."""
    q, k = measured.get("q"), measured.get("k")
    if q is None or k is None or abs(q - k) < 1e-3 * max(abs(q), abs(k), 1e-30):
        return {}  # no factor, or one for q and k alike: a rotary embedding's attention factor (YaRN's mscale)
    said: dict[float, str] = {}
    scaling = getattr(module, "scaling", None)
    if isinstance(scaling, float):
        said[scaling] = f"{type(module).__name__}.scaling={scaling:.4g}"
    said.setdefault(head_dim**-0.5, f"head_dim ** -0.5 = {head_dim**-0.5:.4g}")
    scalar = getattr(getattr(module, "config", None), "query_pre_attn_scalar", None)
    if isinstance(scalar, (int, float)) and scalar > 0:
        said.setdefault(scalar**-0.5, f"query_pre_attn_scalar ** -0.5 = {scalar**-0.5:.4g}")
    return {"scale": _entry(sorted(said), " or ".join(said.values()))}


class Projections:
    """The outputs of one attention module's q and k projections (or norms) in this call, from forward hooks."""

    def __init__(self, module: nn.Module, stack: ExitStack) -> None:
        self.names: tuple[str, str] | None = None
        self.out: dict[str, torch.Tensor] = {}
        for q_name, k_name in PROJECTIONS:
            q, k = getattr(module, q_name, None), getattr(module, k_name, None)
            if isinstance(q, nn.Module) and isinstance(k, nn.Module):
                self.names = (q_name, k_name)
                for side, sub in (("q", q), ("k", k)):
                    self._hook(side, sub, stack)
                break

    def _hook(self, side: str, sub: nn.Module, stack: ExitStack) -> None:
        token = 0

        def after(module, args, output):  # inside the forward: hands over the output, nothing else
            if isinstance(output, torch.Tensor):
                deliver(token, side, [output], [])

        token = listen(sub, "hf-proj", self._receive, stack)
        handle = sub.register_forward_hook(after)
        stack.callback(handle.remove)

    def _receive(self, event: str, tensors: list, numbers: list) -> None:
        self.out[event] = held(tensors[0])

    def measure(self, q: torch.Tensor, k: torch.Tensor) -> dict | None:
        """``{"q": factor, "k": factor, "q_proj": name, "k_proj": name}``: what q ``(batch, head, query, d)`` and k
        ``(batch, kv_head, key, d)`` were multiplied by since their projections (None where they are no multiple);
        None when the projections did not run in this call."""
        if self.names is None or "q" not in self.out or "k" not in self.out:
            self.out.clear()
            return None
        got = dict(zip("qk", _factors([(self.out["q"], q), (self.out["k"], k)]), strict=True))
        self.out.clear()
        return {**got, "q_proj": self.names[0], "k_proj": self.names[1]}


_SAMPLED_TOKENS = 16  # the factor is one number: its rows are read at up to this many tokens of the first sequence


def _factors(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float | None]:
    """The one factor between each row of the projection's output ``(batch, tokens, heads * d)`` (or ``(batch,
    tokens, heads, d)``) and the kernel's ``(batch, heads, tokens + cached, d)`` rows, by their norms (a rotary
    embedding keeps them), for each ``(projection, kernel)`` pair; None when the ratio is not one number (a norm,
    another layout). The rows compared are every head's at up to ``_SAMPLED_TOKENS`` tokens spread over the first
    sequence of this call: a factor is the same on every row, and reading every row cost about 1 ms a layer at 8 x 128
    tokens. One host read for every pair where no row of a projection is (nearly) 0 (the usual case)."""
    norms = [_norms(projected, kernel) for projected, kernel in pairs]
    read = [(a / b, b) for a, b in (n for n in norms if n is not None)]  # (sampled tokens, head) each
    ends = [t for ratio, b in read for t in (b.amax(), b.amin(), ratio.amax(), ratio.amin())]
    found = iter(torch.stack(ends).view(-1, 4).tolist() if ends else [])
    kinds = (kernel.dtype for _, kernel in pairs)
    return [None if n is None else _one_ratio(*n, dtype, next(found)) for n, dtype in zip(norms, kinds, strict=True)]


def _norms(projected: torch.Tensor, kernel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(kernel's, projection's)`` row norms ``(sampled tokens, head)`` each (``_factors``), None where the shapes
    do not pair up. Each side's sampled rows are one strided view (two ops a side: a decoding step runs this on every
    layer, and each small op costs 10-30 us inside a forward)."""
    B, H, T, D = kernel.shape
    if projected.numel() < B * H * D or projected.numel() % (B * H * D):
        return None
    tokens = projected.numel() // (B * H * D)
    if tokens > T or projected.shape[0] != B:
        return None
    step = -(-tokens // _SAMPLED_TOKENS)
    n = -(-tokens // step)  # the sampled tokens: 0, step, 2 step, ...
    ks = kernel.stride()
    with torch.no_grad():
        # (sampled tokens, head, d): this call's rows of the first sequence
        a = kernel.as_strided((n, H, D), (step * ks[2], ks[1], ks[3]), kernel.storage_offset() + (T - tokens) * ks[2])
        b = _sampled(projected, (B, H, tokens, D), step, n)
        a, b = (t if t.dtype == torch.float32 else t.float() for t in (a, b))  # float64 and half read in float32
        return torch.linalg.vector_norm(a, dim=-1), torch.linalg.vector_norm(b, dim=-1)  # (sampled tokens, head)


def _sampled(projected: torch.Tensor, shape: tuple[int, int, int, int], step: int, n: int) -> torch.Tensor:
    """The projection's rows of the first sequence at every ``step``-th token, ``(n, head, d)``: a strided view where
    it is ``(batch, head, tokens, d)`` (normed after the heads' transpose), ``(batch, tokens, head, d)`` or
    ``(batch, tokens, head * d)``, else read through a reshape."""
    B, H, tokens, D = shape
    s, offset = projected.stride(), projected.storage_offset()
    if projected.dim() == 4 and tuple(projected.shape) == (B, H, tokens, D):
        return projected.as_strided((n, H, D), (step * s[2], s[1], s[3]), offset)
    if projected.dim() == 4 and tuple(projected.shape) == (B, tokens, H, D):
        return projected.as_strided((n, H, D), (step * s[1], s[2], s[3]), offset)
    if projected.dim() == 3 and tuple(projected.shape) == (B, tokens, H * D):
        return projected.as_strided((n, H, D), (step * s[1], D * s[2], s[2]), offset)
    return projected[0].reshape(tokens, H, D)[::step]


def _one_ratio(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, ends: list[float]) -> float | None:
    """The middle of ``a / b`` when every ratio is within the dtype's tolerance of it, None otherwise; rows where
    ``b`` is (nearly) 0 left out. ``ends``: ``[max b, min b, max a / b, min a / b]``, read already; a second read
    where some row is (nearly) 0."""
    b_max, b_min, high, low = ends
    if not b_min > 1e-6 * b_max:  # some row of the projection is (nearly) 0: its ratio says nothing
        ok = b > 1e-6 * b_max  # (sampled tokens, head)
        if not bool(ok.any()):
            return None
        ratio = a[ok] / b[ok]
        high, low = torch.stack([ratio.amax(), ratio.amin()]).tolist()
    mid = (high + low) / 2
    if not mid > 0 or not math.isfinite(mid):  # e.g. a static cache: this call's rows are not the last ones
        return None
    tolerance = 1e-3 if dtype in (torch.float32, torch.float64) else 2e-2
    return mid if (high - low) / mid <= tolerance else None
