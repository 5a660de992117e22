"""The ``attnprobe`` command: a thin click layer over the Python API.

Exit codes: 0 success; 1 invariant violations (``attnprobe check``); 2 bad usage or input;
3 an unexpected internal error (a bug: please report it with ``--debug`` output); 130 interrupted
(Ctrl-C: files being written are left as they were).
"""

from __future__ import annotations

import errno
import functools
import json
import os
import shutil
import sys
from pathlib import Path

import click

from . import __version__
from .probe.commandline import targets
from .probe.commandline.interrupts import Commands

EXAMPLES_MODEL = """
MODEL is a local Hugging Face model folder, or package.module:factory (a function returning a model,
or a model and a tokenizer), or nothing for the bundled all-MiniLM-L6-v2.
"""


class UsageProblem(click.ClickException):
    """A bad input or option: one line on stderr, exit code 2."""

    exit_code = 2

    def show(self, file=None) -> None:
        click.echo(f"attnprobe: error: {self.format_message()}", err=True)


class Progress:
    """Stages of a command on stderr (tqdm); silent when stderr is not a terminal or with --quiet."""

    def __init__(self, stages: int, quiet: bool) -> None:
        self.bar = None
        if not quiet and sys.stderr.isatty():
            from tqdm import tqdm

            # a terminal that reports no size (0 x 0) would make tqdm hide the bar; fall back to 80 x 24
            size = shutil.get_terminal_size((80, 24))
            self.bar = tqdm(
                total=stages,
                file=sys.stderr,
                leave=False,
                ncols=size.columns or 80,
                nrows=size.lines or 24,
                bar_format="{desc} [{n_fmt}/{total_fmt}] {elapsed}",
            )

    def stage(self, text: str) -> None:
        if self.bar is not None:
            if self.bar.desc:
                self.bar.update(1)
            self.bar.set_description_str(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


#: OS errors that are about the place the user chose (full disk, no permission, name too long, a failing
#: device): exit 2.
USER_OS_ERRORS = {
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EFBIG,
    errno.EROFS,
    errno.EACCES,
    errno.EPERM,
    errno.ENAMETOOLONG,
    errno.EIO,
}


def handle_errors(fn):
    """Known input problems -> one line and exit 2; anything else -> exit 3; --debug shows tracebacks. Warnings
    (attnprobe's and third-party libraries') are held while the command runs and shown when it ends with a result
    (exit 0 or 1); on an error the one line is all that is printed (--debug shows them too)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        import warnings

        debug = kwargs.get("debug", False)
        result, error = None, None
        with warnings.catch_warnings(record=True) as caught:
            try:
                result = run_command(fn, args, kwargs, debug)
            except BaseException as exc:  # re-raised below, once the warnings are dealt with
                error = exc
        if error is None or debug or _is_result(error):
            for w in caught:  # the command's warnings, as they would have been shown
                warnings.showwarning(w.message, w.category, w.filename, w.lineno, w.file, w.line)
        if error is not None:
            raise error
        return result

    return wrapper


def _is_result(exc: BaseException) -> bool:
    """Whether ``exc`` ends a command with its result (exit 0, or 1: violations found), not with an error."""
    code = exc.exit_code if isinstance(exc, click.exceptions.Exit) else exc.code if isinstance(exc, SystemExit) else 2
    return code in (0, 1, None)


def run_command(fn, args, kwargs, debug):
    """``fn(*args, **kwargs)``, its errors sorted as ``handle_errors`` says."""
    try:
        return fn(*args, **kwargs)
    except click.exceptions.Exit:
        raise
    except (ModelFailed, CaptureFailed) as exc:
        if debug:
            raise exc.__cause__ from None  # the traceback of the failing forward itself
        if isinstance(exc, ModelFailed):
            raise
        cause = exc.__cause__
        click.echo(
            f"attnprobe: internal error: the forward failed under capture with {type(cause).__name__}: "
            f"{cause} and runs without attnprobe: a bug in attnprobe, please report it with the "
            "traceback of --debug",
            err=True,
        )
        sys.exit(3)
    except click.ClickException:
        raise
    except Exception as exc:
        if debug:
            raise
        from .probe.errors import AttnprobeError

        known = (
            AttnprobeError,
            FileExistsError,
            FileNotFoundError,
            PermissionError,
            IsADirectoryError,
            NotADirectoryError,
            ValueError,
            TypeError,
        )
        if isinstance(exc, known):
            raise UsageProblem(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None
        if isinstance(exc, OSError) and exc.errno in USER_OS_ERRORS:  # the place, not attnprobe
            what = f"cannot use {exc.filename}" if exc.filename else "the system refused"
            raise UsageProblem(f"{what}: {exc.strerror or exc}") from None
        click.echo(
            f"attnprobe: internal error: {type(exc).__name__}: {exc} (run again with --debug for the traceback)",
            err=True,
        )
        sys.exit(3)


modules_option = click.option(
    "--modules",
    "modules",
    help="Hand-written attention to read: module names from named_modules(), e.g. blocks.0.attn,blocks.1.attn, "
    "or 'auto' to trace every module (slower); as capture(model, modules=...). `attnprobe info` lists candidates.",
)


TRUST_REMOTE_CODE = click.option(
    "--trust-remote-code",
    is_flag=True,
    help="Run the Python code a model folder ships (auto_map in config.json). Off by default: such a folder is "
    "refused instead; read its code before passing this.",
)


STATS_OPTION = click.option(
    "--stats/--full",
    "stats",
    default=None,
    help="--stats: statistics mode (per-row statistics computed blockwise; memory grows as the input length, not "
    "its square). --full: always a full capture. Default: full, switching to --stats by itself (said on "
    "stderr) when a full capture would pass --max-bytes or the memory available.",
)


def model_and_input_options(fn):
    """MODEL, the inputs, the selection, and --quiet/--debug, shared by every command that runs a model."""
    options = [
        click.argument("model", required=False),
        click.option("--text", "texts", multiple=True, help="Input text; repeat for a padded batch."),
        click.option("--file", "text_file", type=click.Path(dir_okay=False), help="Input texts, one per line."),
        click.option("--decoder-text", "decoder_texts", multiple=True, help="Decoder input (encoder-decoder models)."),
        click.option(
            "--ids", "ids", multiple=True, help="Token ids '101 2023 102' (models without a tokenizer); repeatable."
        ),
        click.option(
            "--layers",
            help="Attention layers, e.g. 0-3,7; negative ones count from the end: --layers=-2--1 (default: all).",
        ),
        click.option("--heads", help="Heads, e.g. 0,5 (default: all)."),
        modules_option,
        click.option("--device", help="Device to run on, e.g. cpu or cuda:0 (default: the model's)."),
        click.option("--dtype", help="Run the model in float32, float16, bfloat16 or float64."),
        click.option("--max-bytes", help="Fail early instead of storing more than this, e.g. 500MB."),
        TRUST_REMOTE_CODE,
        click.option("--quiet", "-q", is_flag=True, help="No progress display."),
        click.option("--debug", is_flag=True, help="Show the full traceback on errors."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def prepare(model, texts, text_file, decoder_texts, ids, device, dtype, progress, trust_remote_code=False, plan=None):
    """The workload of a command: ``--file`` checked and measured before the model loads (a pipe, a device, a file
    over its limit or not text is refused at once), then the model, then the inputs, refused before they are
    tokenized when ``plan`` (``input_plan``) says their capture cannot fit."""
    from .probe.commandline import loading, sizing

    inputs = sizing.sized_texts(texts, text_file)
    progress.stage("loading model")
    torch_dtype = loading.parse_dtype(dtype)
    net, tokenizer, source = loading.load_model(model, dtype=torch_dtype, trust_remote_code=trust_remote_code)
    progress.stage("preparing input")
    return loading.build_workload(
        net,
        tokenizer,
        source,
        texts=inputs,
        decoder_texts=list(decoder_texts),
        ids=loading.parse_ids(ids),
        device=device,
        plan=None if plan is None else plan.check,
    )


def capture_options(layers, heads, max_bytes, keep=None, modules=None) -> dict:
    """The options of ``attnprobe.run`` from the command's --layers, --heads, --max-bytes and --modules."""
    from .probe.commandline import loading
    from .probe.selection import parse_bytes

    return {
        "layers": loading.parse_int_list(layers, "--layers"),
        "heads": loading.parse_int_list(heads, "--heads"),
        "max_bytes": None if max_bytes is None else parse_bytes(max_bytes),
        "keep": keep,
        "modules": loading.parse_modules(modules),
    }


def input_plan(layers, heads, max_bytes, *, keep=None, modules=None, stats=None):
    """The memory plan ``prepare`` asks before the texts are tokenized (``memory_plan.InputPlan``): the capture these
    options make, in the statistics mode unless ``stats`` is False (``--full``) or ``keep`` names tensors."""
    import attnprobe

    from .probe.commandline import memory_plan

    options = capture_options(layers, heads, max_bytes, keep, modules)
    return memory_plan.InputPlan(options, max_bytes, stats, attnprobe.attention_modules)


def run_capture(
    work,
    layers,
    heads,
    max_bytes,
    progress,
    keep=None,
    modules=None,
    *,
    stats=None,
    overview=None,
    found=None,
    image_grid=None,
    spans=None,
):
    """Capture the workload. ``stats``: True = statistics mode (``keep=("stats",)``, nothing grows as query x key),
    None = switch to it by itself (one line on stderr) when a full capture cannot fit --max-bytes (or the memory
    available), False = never. ``overview``: the ``Overview`` a statistics report also keeps. ``found``: the
    attention modules found before the run, when the caller has asked already (``attnprobe.attention_modules``).
    ``image_grid``: the image tokens of a workload with pictures (``capture(image_grid=)``).
    ``spans``: declared spans whose masses a statistics capture computes during the forward."""
    import attnprobe

    from .probe.commandline import memory_plan

    options = capture_options(layers, heads, max_bytes, keep, modules)
    if image_grid is not None:
        options["image_grid"] = image_grid
    found = attnprobe.attention_modules(work.model) if found is None else found
    note = None
    if stats is None:
        note = memory_plan.switch_to_stats(work, options, max_bytes, found)
        stats = note is not None
    if stats:
        options["keep"] = ("stats",)
        if overview is not None:
            options["overview"] = overview
        if spans is not None:
            options["spans"] = spans
    memory_plan.check_input_size(work, options, max_bytes, found)
    progress.stage("capturing attention")
    cap = capture_workload(work, options, max_bytes)
    if note is not None:  # after the capture: an error stays one line
        click.echo(note, err=True)
    return cap


def capture_workload(work, options, max_bytes):
    """``attnprobe.run`` on the workload, its warnings passed on; the library's errors said in command-line words
    (from the data they carry: ``probe.commandline.messages``), a failing forward blamed on the model or on
    attnprobe (``blame_the_forward``)."""
    import warnings

    import attnprobe

    from .probe.commandline import messages
    from .probe.errors import AttnprobeError, CaptureBudgetError, NoAttentionError, SelectionError

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, cap = attnprobe.run(work.model, work.call_inputs, **options)
        if options["modules"] is None and not cap.info.get("attention_modules"):
            raise UsageProblem(messages.no_attention_advice(work.model, work.source))  # instead of the Python advice
        for w in caught:  # the rest as they came
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    except CaptureBudgetError as exc:  # the library's advice names Python arguments (keep=, dtype=) a CLI user lacks
        raise UsageProblem(messages.budget_message(exc, max_bytes)) from None
    except SelectionError as exc:
        raise UsageProblem(messages.selection_message(exc, work.model)) from None
    except NoAttentionError:
        raise UsageProblem(messages.no_attention_advice(work.model, work.source)) from None
    except (AttnprobeError, click.ClickException):
        raise
    except Exception as exc:
        blame_the_forward(work, exc)  # raises ModelFailed (exit 2) or CaptureFailed (exit 3)
    return cap


class ModelFailed(UsageProblem):
    """The user's model raises on the input, also without attnprobe: exit 2, not an internal error."""


def blame_the_forward(work, exc: Exception) -> None:
    """The forward raised under capture: run it once more without attnprobe. When it fails there too,
    the model (or the input) is at fault, and the user is told so instead of reading 'internal error';
    when it runs, the error is attnprobe's own and is re-raised as such (exit 3)."""
    import torch

    try:
        with torch.no_grad():
            work.forward()
    except Exception as plain:
        first = str(plain).strip().splitlines()[0] if str(plain).strip() else ""
        raise ModelFailed(
            f"the model fails on this input also without attnprobe: {type(plain).__name__}"
            f"{': ' + first if first else ''} (--debug shows the traceback)"
        ) from exc
    raise CaptureFailed() from exc


class CaptureFailed(Exception):
    """The forward failed under capture and runs without it: attnprobe's fault (exit 3); ``__cause__``."""


@click.group(cls=Commands, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="attnprobe")
def main() -> None:
    """Capture, check and report attention in PyTorch and Hugging Face models.

    \b
    attnprobe report                    an HTML report of the bundled MiniLM on a default sentence
    attnprobe check                     check its attention invariants (exit code 1 on a violation)
    attnprobe compare REF CAND --ids "1 2 3"  two implementations head by head: the first divergence and its cause
    attnprobe info                      what attention the bundled MiniLM has
    attnprobe export --out frame.parquet  the tidy frame, one row per layer, head, query and key
    attnprobe COMMAND --help            options and more examples
    """


@main.command()
@click.argument("model", required=False)
@modules_option
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@TRUST_REMOTE_CODE
@click.option("--quiet", "-q", is_flag=True, help="No progress display.")
@click.option("--debug", is_flag=True, help="Show the full traceback on errors.")
@handle_errors
def info(model, modules, fmt, trust_remote_code, quiet, debug):
    """List the attention modules of MODEL: layers, heads (query / kv), backend, capture strategy.

    A model folder is read from its config alone (on the meta device): no weights are loaded.
    When attnprobe finds no attention it reads by itself, the modules whose code computes a softmax
    are listed as candidates for --modules (hand-written attention).

    \b
    Examples:
      attnprobe info
      attnprobe info ./my-bert
      attnprobe info mypkg.models:tiny_gpt --format json
      attnprobe info mypkg.models:nanogpt --modules transformer.h.0.attn,transformer.h.1.attn
    """
    from .probe.commandline.candidates import softmax_modules

    net, source, found, names = find_attention(model, modules, trust_remote_code, quiet)
    read = [m.name for m in found]
    candidates = [
        c for c in softmax_modules(net) if not any(c.name == n or c.name.startswith(n + ".") or not n for n in read)
    ]
    backend = getattr(getattr(net, "config", None), "_attn_implementation", None)
    if fmt == "json":
        click.echo(
            json.dumps(
                {
                    "model": source,
                    "class": type(net).__name__,
                    "backend": backend,
                    "attention_modules": [m.__dict__ for m in found],
                    "candidates": [c.__dict__ for c in candidates],
                    "traced_at_run_time": names == "auto",
                },
                indent=2,
            )
        )
        return
    click.echo(f"model:    {source}")
    click.echo(f"class:    {type(net).__name__}" + (f" (attention implementation: {backend})" if backend else ""))
    click.echo(f"layers:   {len(found)} attention module(s)")
    if names == "auto":
        click.echo(
            "--modules auto: every module is traced while the model runs; hand-written attention is "
            "numbered then (check, report and export show it)"
        )
    if found:
        rows = [("layer", "name", "class", "heads q/kv", "strategy")]
        for m in found:
            heads = "?" if m.num_heads is None else f"{m.num_heads}/{m.num_kv_heads}"  # traced: known once it runs
            rows.append((str(m.layer), m.name or "<root>", m.module_class, heads, m.strategy))
        echo_table(rows)
    echo_candidates(candidates, found, names)


def find_attention(model, modules, trust_remote_code: bool, quiet: bool):
    """(model, its source, the attention modules found, the parsed --modules) for ``info``: a model folder is
    built on the meta device from its config (no weights read)."""
    import attnprobe

    from .hooks import default_adapters
    from .probe.commandline import loading, messages

    progress = Progress(2, quiet)
    try:
        progress.stage("loading model")
        net, _, source = loading.load_model(model, trust_remote_code=trust_remote_code, weights=False)
        progress.stage("finding attention")
        names = loading.parse_modules(modules)
        try:
            found = attnprobe.attention_modules(
                net, adapters=None if names is None else default_adapters(modules=names)
            )
        except attnprobe.SelectionError as exc:
            raise UsageProblem(messages.selection_message(exc, net)) from None
    finally:
        progress.close()
    return net, source, found, names


def echo_candidates(candidates, found, names) -> None:
    """``info``'s lines on the modules whose code computes a softmax (hand-written attention to name with
    --modules), or why none is listed."""
    if candidates and (not found or names is None):
        click.echo(
            ("no attention module found that attnprobe reads by itself; " if not found else "also ")
            + "these modules compute a softmax in their code (hand-written attention?):"
        )
        echo_table(
            [("name", "class", "softmax at")] + [(c.name or "<root>", c.module_class, c.where) for c in candidates],
            indent="  ",
        )
        listed = ",".join(c.name or "<root>" for c in candidates)
        click.echo(f"read them with --modules {listed} (or --modules auto), in check, report, export and info")
    elif not found and names != "auto":
        click.echo(
            "no attention module found, and no module's code calls softmax; direct scaled_dot_product_attention "
            "calls are found only while the model runs (check, report, export); for attention reached "
            "indirectly use --modules auto"
        )


def echo_table(rows: list[tuple[str, ...]], indent: str = "") -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        click.echo(indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


@main.command()
@model_and_input_options
@click.option("--out", "out", required=True, type=click.Path(dir_okay=False), help="Output file: .parquet or .csv.")
@click.option(
    "--what",
    type=click.Choice(["frame", "summary"]),
    default="frame",
    show_default=True,
    help="The tidy frame (one row per layer, head, batch, query, key) or the per-head summary.",
)
@click.option(
    "--drop-padding",
    is_flag=True,
    help="Leave out the rows of padded queries (frame only; the query_padding column marks them otherwise).",
)
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
@click.option(
    "--raw-csv",
    is_flag=True,
    help="Write text cells as they are. By default a CSV text cell starting with =, +, -, @, tab or CR "
    "gets a leading ' so that a spreadsheet shows it instead of evaluating it.",
)
@handle_errors
def export(
    model,
    texts,
    text_file,
    decoder_texts,
    ids,
    layers,
    heads,
    modules,
    device,
    dtype,
    max_bytes,
    trust_remote_code,
    quiet,
    debug,
    out,
    what,
    drop_padding,
    overwrite,
    raw_csv,
):
    """Capture MODEL on the input and write the tidy frame or the per-head summary.

    \b
    Examples:
      attnprobe export --out attention.parquet
      attnprobe export ./my-bert --text "hello world" --layers 0-1 --out frame.csv
      attnprobe export --what summary --out heads.csv
    """
    from .probe.outputs.frames import write_frame

    if drop_padding and what != "frame":
        raise UsageProblem("--drop-padding applies to --what frame; the summary leaves padded rows out already")
    out_path = targets.checked_name(out)
    if out.endswith(("/", os.sep)):  # Path() drops the slash: "x.csv/" would become the file x.csv
        raise UsageProblem(
            f"--out {out!r} ends with a slash (a folder); export writes one file: "
            "name it .parquet or .csv, e.g. --out attention.parquet"
        )
    if out_path.suffix.lower() not in (".parquet", ".pq", ".csv"):
        raise UsageProblem(f"--out {out!r}: name the file .parquet or .csv")
    if raw_csv and out_path.suffix.lower() != ".csv":
        raise UsageProblem("--raw-csv applies to .csv output; Parquet always stores the text exactly")
    targets.check_output(out_path, overwrite)
    keep = ["scores", "weights"] if what == "frame" else ["weights"]
    plan = input_plan(layers, heads, max_bytes, keep=keep, modules=modules)
    progress = Progress(4, quiet)
    try:
        work = prepare(model, texts, text_file, decoder_texts, ids, device, dtype, progress, trust_remote_code, plan)
        cap = run_capture(work, layers, heads, max_bytes, progress, keep=keep, modules=modules, found=plan.found)
        progress.stage("building frame")
        out_path.parent.mkdir(parents=True, exist_ok=True)
        tokens, key_tokens = token_labels(work)
        if what == "frame":
            frame = cap.to_frame(tokens=tokens, key_tokens=key_tokens, drop_padding=drop_padding)
        else:
            frame = cap.summary()  # padded rows are never in the summary's means
        written = write_frame(frame, out_path, overwrite=overwrite, formula_safe=not raw_csv)
    finally:
        progress.close()
    click.echo(f"wrote {written} ({len(frame):,} rows, {what})")


@main.command()
@model_and_input_options
@click.option("--out", help="An .html file, a .png file, or a folder (default: attnprobe-report.html).")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["html", "png", "all"]),
    help="What to write (default: what --out names: NAME.png a PNG grid, NAME.html or a folder the HTML "
    "report; all = HTML and PNGs into a folder).",
)
@click.option(
    "--batch",
    type=int,
    help="The one batch row to show (default: every row in the HTML, up to 8, with a selector; row 0 in the PNG grid).",
)
@click.option(
    "--precision",
    type=click.Choice(["exact", "bfloat16"]),
    default="exact",
    show_default=True,
    help="Values in the HTML: exact float32, or bfloat16 for a smaller file.",
)
@click.option("--overwrite", is_flag=True, help="Replace existing output files.")
@STATS_OPTION
@click.option(
    "--window",
    "windows",
    multiple=True,
    metavar="Q0:Q1,K0:K1",
    help="Statistics mode: also store the exact weights of query rows Q0:Q1 x keys K0:K1 (repeatable; "
    "default: the first and the last 128 x 128). Implies --stats.",
)
@click.option(
    "--cells",
    type=click.IntRange(1, 512),
    default=None,
    help="Statistics mode: pool each head's weights to at most this many cells a side (max and mean; "
    "default 512 for up to 2 heads, 256 up to 8, 128 beyond). Implies --stats.",
)
@click.option(
    "--image",
    "images",
    multiple=True,
    type=click.Path(dir_okay=False),
    help="A picture for a vision model or a vision-language model (repeatable; MODEL's folder holds its processor; "
    "--text is the prompt): the report's Image section draws attention over it.",
)
@click.option(
    "--spans",
    "span_spec",
    metavar="SPEC",
    help="Declare spans: 'sentences' (each input text's sentences) or token ranges 'NAME=START:STOP,...'. The "
    "report marks each token's span and adds the span x span attention of every layer.",
)
@handle_errors
def report(
    model,
    texts,
    text_file,
    decoder_texts,
    ids,
    layers,
    heads,
    modules,
    device,
    dtype,
    max_bytes,
    trust_remote_code,
    quiet,
    debug,
    out,
    fmt,
    batch,
    precision,
    overwrite,
    stats,
    windows,
    cells,
    images,
    span_spec,
):
    """Capture MODEL on the input and write an HTML report and/or PNG heatmaps.

    \b
    Examples:
      attnprobe report                                  # the bundled MiniLM, a default sentence
      attnprobe report --text "The cat sat." --text "Hi" --out cats.html
      attnprobe report ./my-gpt2 --layers 0-3 --heads 0,5 --format all --out gpt2-report
      attnprobe report ./my-t5 --text "translate: hi" --decoder-text "<pad> hallo"
      attnprobe report mypkg.models:tiny --ids "1 5 9 2" --out heads.png   # the format from the suffix
      attnprobe report ./my-llama --file long.txt --stats --window 4000:4100,0:200 --format all
      attnprobe report ./my-llava --image photo.png --text "What is she wearing?"   # attention over the picture
      attnprobe report --text "The cat sat. It was tired." --spans sentences

    A long input (or --stats) gives a statistics report: per head the weights pooled to at most --cells cells,
    per-row statistics along the sequence, and the exact weights of the --window choices.
    """
    fmt = targets.report_format(out, fmt)
    if precision != "exact" and fmt == "png":
        raise UsageProblem(
            "--precision sets how values are stored in the HTML report; --format png writes no HTML "
            "(use --format all, or leave --precision out)"
        )
    if (windows or cells is not None) and stats is False:
        raise UsageProblem("--window and --cells belong to the statistics mode; leave out --full")
    planned = targets.report_targets(out, fmt, overwrite)
    plan = input_plan(layers, heads, max_bytes, modules=modules, stats=True if windows or cells is not None else stats)
    progress = Progress(5, quiet)  # loading, preparing, capturing, checking, writing
    try:
        if images:
            work = prepare_pictures(model, images, texts, text_file, ids, device, dtype, progress, trust_remote_code)
        else:
            work = prepare(
                model, texts, text_file, decoder_texts, ids, device, dtype, progress, trust_remote_code, plan
            )
        n_rows = len(next(iter(work.inputs.values())))
        if batch is not None and not 0 <= batch < n_rows:
            raise UsageProblem(f"--batch {batch} is out of range: the input has {n_rows} row(s)")
        from .probe.commandline.span_options import parse_spans

        spans = parse_spans(span_spec, work)
        cap = report_capture(work, layers, heads, max_bytes, progress, modules, stats, windows, cells, spans)
        progress.stage("checking")
        checks = report_checks(work, cap)
        progress.stage("writing report")
        written = write_reports(
            cap, planned, work, checks, batch=batch, precision=precision, overwrite=overwrite, spans=spans
        )
    finally:
        progress.close()
    for path in written:
        click.echo(f"wrote {path}")


def report_capture(work, layers, heads, max_bytes, progress, modules, stats, windows, cells, spans=None):
    """The capture a report draws: full, or statistics with the overview of --cells and --window (which imply
    --stats) and the masses of the --spans; refused when no attention call was captured."""
    import attnprobe

    from .probe.commandline import memory_plan

    if windows or cells is not None:
        stats = True
    found = attnprobe.attention_modules(work.model)
    overview = memory_plan.statistics_overview(work, heads, windows, cells, found)
    cap = run_capture(
        work,
        layers,
        heads,
        max_bytes,
        progress,
        modules=modules,
        stats=stats,
        overview=overview,
        found=found,
        image_grid=getattr(work, "image_tokens", None),
        spans=spans,
    )
    if len(cap) == 0:
        raise UsageProblem("the model ran but no attention call was captured; see `attnprobe info` for what was found")
    return cap


def prepare_pictures(model, images, texts, text_file, ids, device, dtype, progress, trust_remote_code=False):
    """The workload of ``report --image``: MODEL's folder's processor on the pictures and the prompt (``--text``)."""
    from pathlib import Path

    from .probe.commandline import images as pictures
    from .probe.commandline import loading

    if ids:
        raise UsageProblem("--image takes the prompt as --text, not --ids")
    progress.stage("loading model")
    net, tokenizer, source = loading.load_model(
        model, dtype=loading.parse_dtype(dtype), trust_remote_code=trust_remote_code
    )
    progress.stage("preparing input")
    folder = Path(model) if model is not None and Path(model).is_dir() else None
    work = pictures.build_image_workload(net, tokenizer, source, folder, images, loading.read_texts(texts, text_file))
    if device is not None:
        work.model = net.to(device)
        work.inputs = {k: v.to(device) if hasattr(v, "to") else v for k, v in work.inputs.items()}
    return work


def report_pictures(work, cap):
    """The pictures of the report's Image section: those of ``report --image`` when the capture holds weights to
    draw (a statistics capture has none: said on stderr)."""
    pictures = getattr(work, "pictures", None)
    if not pictures:
        return None
    if all(r.weights is None for r in cap):
        click.echo(
            "attnprobe: the statistics report has no Image section (no weights to draw on the picture)", err=True
        )
        return None
    return pictures


def report_checks(work, cap):
    """The report's checks panel: every check, with the padding (and an encoder-decoder's causality) declared;
    their warnings are left to `attnprobe check`."""
    import warnings

    import attnprobe

    declared_causal, declared_mask = declarations(work, cap)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # `attnprobe check` reports these; the report shows its panel
        return attnprobe.check(cap, causal=declared_causal, attention_mask=declared_mask)


def write_reports(
    cap, planned: dict[str, Path], work, checks, *, batch, precision, overwrite, spans=None
) -> list[Path]:
    """Write what ``targets.report_targets`` planned (the HTML report, the PNG grid, the summary plot); their
    paths. ``spans``: marked in the HTML report, with every layer's span x span attention."""
    import attnprobe

    from . import reports

    for target in planned.values():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageProblem(f"cannot create the folder {target.parent}: {exc.strerror}") from None
    tokens, key_tokens = token_labels(work)
    written = []
    if "html" in planned:
        title = f"attnprobe report: {work.source}"
        written.append(
            reports.to_html(
                cap,
                planned["html"],
                tokens=tokens,
                key_tokens=key_tokens,
                batch=batch,
                checks=checks,
                precision=precision,
                overwrite=overwrite,
                title=title,
                image=report_pictures(work, cap),
                spans=spans,
                analyses=None if spans is None else [attnprobe.spans.attention(cap, spans, level="layer")],
            )
        )
    if "grid" in planned:
        written.append(
            reports.save_grid(
                cap, planned["grid"], batch=batch or 0, overwrite=overwrite, tokens=tokens, key_tokens=key_tokens
            )
        )
    if "summary" in planned:
        written.append(reports.save_summary(cap, planned["summary"], overwrite=overwrite))
    return written


@main.command()
@model_and_input_options
@click.option(
    "--causal/--no-causal",
    default=None,
    help="Declare the self-attention causal (or bidirectional) and check the model against it "
    "(default: each layer's own mask is the reference; an encoder-decoder's decoder is "
    "declared causal). In an encoder-decoder this concerns the decoder's self-attention only.",
)
@click.option(
    "--sliding-window",
    type=click.IntRange(min=1),
    help="Declare a sliding window W for every layer: a key more than W - 1 positions before the query must get no "
    "weight, and keys inside it must not be masked.",
)
@click.option(
    "--prefix-length",
    type=click.IntRange(min=0),
    help="Declare a prefix-LM: the first N tokens see each other, the rest is causal.",
)
@click.option(
    "--chunk-size",
    type=click.IntRange(min=1),
    help="Declare Llama 4-style chunked attention: a query sees the keys of its own chunk of N tokens only.",
)
@click.option(
    "--scale",
    type=float,
    help="Declare the softmax scale every layer should use (checked against the scale measured from q and k).",
)
@click.option("--checks", "check_names", help="Only these checks, e.g. causal,padding (default: all).")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@STATS_OPTION
@handle_errors
def check(
    model,
    texts,
    text_file,
    decoder_texts,
    ids,
    layers,
    heads,
    modules,
    device,
    dtype,
    max_bytes,
    trust_remote_code,
    quiet,
    debug,
    causal,
    sliding_window,
    prefix_length,
    chunk_size,
    scale,
    check_names,
    fmt,
    stats,
):
    """Capture MODEL on the input and check attention invariants (for CI).

    Exit code 0 when clean, 1 when an invariant is violated or nothing could be verified (for example
    --checks lint on a model without hand-written attention), 2 on bad usage or input (also a model
    that fails on the input without attnprobe), 3 when attnprobe itself fails (please report it).
    The input padding mask is declared for you (padded keys must get no weight); --sliding-window,
    --prefix-length, --chunk-size and --scale declare what the attention should be (docs/checks.md), beside
    what the model declares itself.

    \b
    Examples:
      attnprobe check                                   # the bundled MiniLM
      attnprobe check ./my-gpt2 --causal --text "a" --text "longer input"
      attnprobe check mypkg.models:decoder --ids "1 2 3" --checks causal,padding --format json
    """
    names = check_selection(check_names)
    plan = input_plan(layers, heads, max_bytes, modules=modules, stats=stats)
    progress = Progress(4, quiet)
    try:
        work = prepare(model, texts, text_file, decoder_texts, ids, device, dtype, progress, trust_remote_code, plan)
        cap = run_capture(work, layers, heads, max_bytes, progress, modules=modules, stats=stats, found=plan.found)
        progress.stage("checking")
        shorthands = dict(sliding_window=sliding_window, prefix_length=prefix_length, chunk_size=chunk_size)
        result, notes = run_checks(work, cap, causal, names, scale=scale, **shorthands)
    finally:
        progress.close()
    if fmt == "json":
        click.echo(json.dumps(check_json(work, result, notes), indent=2))
    else:
        click.echo(f"model: {work.source}")
        click.echo(result.table())
        for note in notes:
            click.echo(f"warning: {note}", err=True)
    if not result.verified:
        lint_only = names is not None and all(n == "lint" or n.startswith("lint_") for n in names)
        why = (
            " (the lint checks apply only to traced hand-written attention and direct "
            "scaled_dot_product_attention calls)"
            if lint_only
            else ""
        )
        click.echo(
            f"error: no check could run on the {result.records} captured record(s){why}; a check that "
            "verified nothing does not pass",
            err=True,
        )
        sys.exit(1)
    sys.exit(0 if result.ok else 1)


def check_selection(check_names: str | None) -> list[str] | None:
    """--checks as a list of names (None: every check), refusing a name that is not a check."""
    from .probe.checks import CHECKS

    if check_names is None:
        return None
    names = [c.strip() for c in check_names.split(",") if c.strip()]
    unknown = [c for c in names if c not in CHECKS and c != "lint" and not c.startswith("lint_")]
    if unknown or not names:
        raise UsageProblem(f"unknown check(s) {unknown or check_names!r}; choose from {', '.join(CHECKS)}, lint")
    return names


def run_checks(work, cap, causal, names, **declared):
    """(``attnprobe.check`` of the capture with the input's padding, --causal and the other declarations
    (``declared``: sliding_window=, prefix_length=, chunk_size=, scale=; None = not declared), its warnings' text)."""
    import warnings

    import attnprobe

    declared_causal, declared_mask = declarations(work, cap, causal)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = attnprobe.check(cap, causal=declared_causal, attention_mask=declared_mask, checks=names, **declared)
    return result, [str(w.message) for w in caught]


def check_json(work, result, notes: list[str]) -> dict:
    """``check --format json``: the result as data."""
    return {
        "model": work.source,
        "ok": result.ok,
        "verified": result.verified,
        "records": result.records,
        "checks": list(result.checks),
        "violations": [_violation_json(v) for v in result.violations],
        "skipped": list(result.skipped),
        "declarations": list(result.declarations),
        "warnings": notes,
    }


def _violation_json(v) -> dict:
    import dataclasses

    out = dataclasses.asdict(v)
    out["queries"], out["keys"] = list(v.queries), list(v.keys)
    return out


def declarations(work, cap, causal=None):
    """(causal, attention_mask) to declare to the checks: the padding the user fed, per layer where needed.

    A decoder-only or encoder model: the input's attention mask for every layer. An encoder-decoder:
    per layer, the encoder mask for encoder self-attention and for cross-attention (its keys are the
    encoder's positions), the decoder mask for decoder self-attention, which is also declared causal
    unless ``causal`` says otherwise. ``causal`` concerns the decoder only there: the encoder's
    self-attention is bidirectional by design and keeps its own mask as the reference.
    """
    if not work.is_encoder_decoder:
        mask = work.inputs.get("attention_mask")
        if mask is not None and not any((r.batch_size, r.key_len) == tuple(mask.shape) for r in cap):
            mask = None  # a model that changes the sequence (pooling, a prefix): each record's own mask
        return causal, mask
    encoder = work.inputs.get("attention_mask")
    decoder = work.inputs.get("decoder_attention_mask")
    masks, causal_by_layer = {}, {}
    for record in cap:
        stack = record.meta.get("stack")
        if record.kind == "cross" or stack == "encoder":
            mask = encoder
        elif stack == "decoder":
            mask = decoder
            causal_by_layer[record.layer] = True if causal is None else causal
        else:
            continue
        if mask is not None:
            masks[record.layer] = mask
    return causal_by_layer or None, masks or None


def token_labels(work):
    """(tokens, key_tokens) for frames and reports: decoder tokens query the encoder's in encoder-decoders."""
    if work.is_encoder_decoder:
        return work.decoder_tokens, work.tokens
    return work.tokens, None


@main.command()
@click.argument("reference")
@click.argument("candidate")
@click.option("--text", "texts", multiple=True, help="Input text (the reference's tokenizer); repeat for a batch.")
@click.option("--file", "text_file", type=click.Path(dir_okay=False), help="Input texts, one per line.")
@click.option("--ids", "ids", multiple=True, help="Token ids '101 2023 102'; repeatable.")
@click.option("--decoder-text", "decoder_texts", multiple=True, help="Decoder input (encoder-decoder models).")
@click.option(
    "--mapping",
    help="Which calls correspond, REFERENCE=CANDIDATE by layer number or module name, e.g. 0=0,1=2 "
    "(default: forward order).",
)
@click.option("--modules", help="Hand-written attention to read in both, as --modules of check ('auto': all).")
@click.option("--reference-modules", help="--modules for the reference only.")
@click.option("--candidate-modules", help="--modules for the candidate only, e.g. auto for a hand-written port.")
@click.option("--atol", type=float, help="Absolute tolerance (default by dtype).")
@click.option("--rtol", type=float, help="Relative tolerance, times the head's largest value (default by dtype).")
@click.option("--allow-permuted-heads", is_flag=True, help="Heads in another order are matched, not a divergence.")
@click.option("--html", "html", type=click.Path(dir_okay=False), help="Also write the diff report to this file.")
@click.option("--overwrite", is_flag=True, help="Replace the --html file if it exists.")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.option("--device", help="Device to run both on, e.g. cpu or cuda:0 (default: each model's).")
@click.option("--dtype", help="Run both in float32, float16, bfloat16 or float64.")
@click.option("--candidate-dtype", help="Run the candidate in this dtype (e.g. bfloat16 against float32).")
@click.option("--max-bytes", help="Fail early instead of storing more than this per model, e.g. 500MB.")
@STATS_OPTION
@TRUST_REMOTE_CODE
@click.option("--quiet", "-q", is_flag=True, help="No progress display.")
@click.option("--debug", is_flag=True, help="Show the full traceback on errors.")
@handle_errors
def compare(reference, candidate, **options):
    """Run two implementations of one model on the same input and compare them head by head.

    REFERENCE and CANDIDATE are model folders or package.module:factory (as for check); the candidate gets
    exactly the reference's inputs. Prints one line: agreement, or the first divergence (layer, head,
    tensor, position, both values) and its likely cause (scale, mask, rope_layout, rope_base, positions,
    head_order, kv_repeat, softcap, softmax_dtype or unknown) with its evidence.

    Exit code 0 when they agree within tolerance, 1 when they differ, 2 on bad usage or input (also two
    models whose attention calls cannot be lined up: give --mapping), 3 when attnprobe itself fails.

    \b
    Examples:
      attnprobe compare ./gpt2 mypkg.port:gpt --ids "464 2068 7586" --candidate-modules auto
      attnprobe compare ./llama ./llama --candidate-dtype bfloat16 --text "a sentence"
      attnprobe compare ref:model port:model --ids "1 2 3" --mapping 0=0,1=2 --html compare.html
    """
    import attnprobe

    from .probe.commandline import comparing

    o = options
    mapping = comparing.parse_mapping(o["mapping"])
    if o["html"]:
        targets.check_output(Path(o["html"]), o["overwrite"])  # before the work, not after
    progress = Progress(6, o["quiet"])
    try:
        ref_work, cand_work = compare_workloads(reference, candidate, o, progress)
        ref_cap, cand_cap = capture_both(ref_work, cand_work, o, progress)
        progress.stage("comparing")
        result = attnprobe.compare(
            ref_cap,
            cand_cap,
            mapping=mapping,
            atol=o["atol"],
            rtol=o["rtol"],
            allow_permuted_heads=o["allow_permuted_heads"],
            batch=int(next(iter(ref_work.inputs.values())).shape[0]),
        )
        if o["html"]:
            Path(o["html"]).parent.mkdir(parents=True, exist_ok=True)
            attnprobe.reports.diff_html(result, o["html"], overwrite=o["overwrite"])
    finally:
        progress.close()
    if o["fmt"] == "json":
        click.echo(json.dumps(comparing.comparison_json(result, ref_work.source, cand_work.source), indent=2))
    else:
        click.echo(result.summary())
    sys.exit(0 if result.ok else 1)


def capture_both(ref_work, cand_work, o, progress):
    """Both captures, in one mode: the reference's (full, or statistics by --stats or by itself when a full capture
    would not fit), and the candidate's in the same."""
    ref_modules, cand_modules = o["reference_modules"] or o["modules"], o["candidate_modules"] or o["modules"]
    ref_cap = run_capture(ref_work, None, None, o["max_bytes"], progress, modules=ref_modules, stats=o["stats"])
    statistics = ref_cap[0].weights is None and ref_cap[0].stats is not None
    cand_cap = run_capture(cand_work, None, None, o["max_bytes"], progress, modules=cand_modules, stats=statistics)
    return ref_cap, cand_cap


def compare_workloads(reference, candidate, o, progress):
    """The reference's workload (its inputs from --text/--file/--ids), and the candidate's on the same inputs."""
    from .probe.commandline import comparing, loading

    # the memory plan of the reference's capture, asked before its inputs are tokenized (as check and report do)
    plan = input_plan(None, None, o["max_bytes"], modules=o["reference_modules"] or o["modules"], stats=o["stats"])
    ref_work = prepare(
        reference,
        o["texts"],
        o["text_file"],
        o["decoder_texts"],
        o["ids"],
        o["device"],
        o["dtype"],
        progress,
        o["trust_remote_code"],
        plan,
    )
    progress.stage("loading candidate")
    dtype = loading.parse_dtype(o["candidate_dtype"] or o["dtype"])
    model, tokenizer, source = loading.load_model(candidate, dtype=dtype, trust_remote_code=o["trust_remote_code"])
    return ref_work, comparing.candidate_workload(ref_work, model, tokenizer, source, o["device"])


@main.command()
@click.argument("model", required=False)
@click.option(
    "--data",
    "data",
    required=True,
    type=click.Path(exists=True),
    help="Inputs: .txt (one per line), .jsonl, .csv, .parquet, or a datasets save_to_disk folder.",
)
@click.option("--out", "out", required=True, type=click.Path(file_okay=False), help="Folder for the Parquet dataset.")
@click.option("--field", help="The text field of .jsonl (default: text), .csv, .parquet or a datasets folder.")
@click.option(
    "--batch-size", type=click.IntRange(min=1), default=16, show_default=True, help="Inputs per forward (padded)."
)
@click.option("--max-length", type=click.IntRange(min=1), help="Truncate inputs to this many tokens.")
@click.option("--layers", help="Attention layers, e.g. 0-3,7 (default: all).")
@click.option("--heads", help="Heads, e.g. 0,5 (default: all).")
@modules_option
@click.option("--limit", type=click.IntRange(min=1), help="Scan only the first N inputs.")
@click.option(
    "--chunk-size",
    type=click.IntRange(min=1),
    default=256,
    show_default=True,
    help="Inputs per Parquet file (an interrupted scan loses at most one chunk).",
)
@click.option("--resume", is_flag=True, help="Skip the chunks already written in OUT.")
@click.option(
    "--engine",
    type=click.Choice(["torch", "ray"]),
    default="torch",
    show_default=True,
    help="ray: the chunks run as tasks on a Ray cluster (pip install 'attnprobe[ray]'), each actor loading MODEL once.",
)
@click.option("--concurrency", type=click.IntRange(min=1), help="With --engine ray: how many actors (default 1).")
@click.option("--num-gpus", type=click.FloatRange(min=0), help="With --engine ray: GPUs per actor.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option("--debug", is_flag=True, help="Show the full traceback on errors.")
@handle_errors
def scan(
    model,
    data,
    out,
    field,
    batch_size,
    max_length,
    layers,
    heads,
    modules,
    limit,
    chunk_size,
    resume,
    engine,
    concurrency,
    num_gpus,
    quiet,
    debug,
):
    """Per-head attention statistics of MODEL over every input of --data, to a Parquet dataset in --out.

    One row per input, layer and head: each statistic averaged over the input's real query rows, plus
    row-level extremes (entropy_min, max_score_max, ...). No (query x key) tensor is stored, so memory stays
    flat in the number of inputs. Runs unchanged under `accelerate launch --num_processes N -m attnprobe scan`
    and `torchrun` (each process scans its own chunks; a model split across processes by tensor or pipeline
    parallelism is fed the same inputs on the processes that hold it), or on a Ray cluster with --engine ray.

    MODEL is a model folder with its tokenizer, or a factory returning (model, tokenizer); a model whose forward
    takes the token ids positionally (nanoGPT's forward(idx, targets=None)) is fed them so, and hand-written
    attention is read with --modules (as in check).

    \b
    Examples:
      attnprobe scan --data sentences.txt --out scan/
      attnprobe scan ./my-bert --data data.jsonl --engine ray --concurrency 4 --out scan/
      attnprobe scan ./my-bert --data data.jsonl --field text --batch-size 32 --max-length 128 --out scan/
      attnprobe scan mypkg.models:nanogpt --data data.txt --modules auto --out scan/
      duckdb -c "SELECT layer, head, avg(entropy) FROM 'scan/*.parquet' GROUP BY ALL"
    """
    from .probe.commandline import loading

    if engine != "ray" and (concurrency is not None or num_gpus is not None):
        raise UsageProblem("--concurrency and --num-gpus place Ray actors: they go with --engine ray")
    options = {
        "field": field,
        "batch_size": batch_size,
        "max_length": max_length,
        "layers": loading.parse_int_list(layers, "layers"),
        "heads": loading.parse_int_list(heads, "heads"),
        "modules": loading.parse_modules(modules),
        "limit": limit,
        "resume": resume,
        "chunk_size": chunk_size,
        "progress": not quiet,
    }
    if engine == "ray":  # every actor loads the model itself, from the folder or factory named here
        options.update(engine="ray", concurrency=concurrency, num_gpus=num_gpus)
        result = scan_model(model or str(loading.bundled_model_path()), None, data, out, options)
    else:
        net, tokenizer, source = loading.load_model(model)
        if tokenizer is None:
            raise UsageProblem(
                f"{source} has no tokenizer and a scan reads texts: make the factory return (model, tokenizer), "
                "or give a model folder with its tokenizer"
            )
        result = scan_model(net, tokenizer, data, out, options, source=source)
    skipped = f", {result.chunks_skipped} chunk(s) already there" if result.chunks_skipped else ""
    click.echo(
        f"scanned {result.inputs} input(s) into {result.out}/ ({result.chunks_written} chunk(s) written{skipped})"
    )


def scan_model(net, tokenizer, data, out, options: dict, source: str | None = None):
    """``attnprobe.scan`` for the ``scan`` command; the library's errors on the model's attention (none found,
    --modules naming what is not there) said in command-line words (``probe.commandline.messages``)."""
    import attnprobe

    from .probe.commandline import messages
    from .probe.errors import NoAttentionError, SelectionError

    try:
        return attnprobe.scan(net, data, out, tokenizer=tokenizer, **options)
    except NoAttentionError:
        if isinstance(net, str):
            raise
        raise UsageProblem(messages.no_attention_advice(net, source or type(net).__name__)) from None
    except SelectionError as exc:
        if isinstance(net, str):
            raise
        raise UsageProblem(messages.selection_message(exc, net)) from None


if __name__ == "__main__":  # pragma: no cover
    main()
