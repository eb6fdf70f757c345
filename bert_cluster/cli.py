"""The ``bert-cluster`` command: a shell over ``bert_cluster.evaluation``, ``.inspection`` and ``.info()``.

Each command parses its options, builds the objects the API takes (a ``ClusteredAttentionConfig``, or
the settings to change in it), calls the API and renders the result with rich (the reporters and
tables are in ``bert_cluster.render``): tables on stdout, progress and errors on stderr. A
user mistake becomes one line on stderr and exit code 2, without a traceback; Ctrl-C during a run says
in one line where the partial results are (exit 130).
``python -m bert_cluster`` is the same command (so ``accelerate launch -m bert_cluster evaluate`` works).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import inspect
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from typer.core import TyperGroup

# Evaluation and embedding (datasets, sentence-transformers) and the kernels are imported inside the
# commands that run them: a command loads only what it uses (`--help` none of them).
from bert_cluster import __version__
from bert_cluster.config import BACKENDS, MODES, ClusteredAttentionConfig
from bert_cluster.inspection import DEFAULT_MAX_ERROR
from bert_cluster.serve.settings import ServeSettings

#: click's usage error (typer 0.2x vendors its own click): the base of typer.BadParameter.
_UsageError = next(base for base in typer.BadParameter.__mro__ if base.__name__ == "UsageError")


class _OneLineUsageErrors(TyperGroup):
    """The command group: a command's usage errors are one line on stderr and exit code 2.

    An unknown option, a bad choice, a missing argument: as every other user error here, not a usage box.
    """

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except _UsageError as error:
            if type(error).__name__ == "NoArgsIsHelpError":  # a bare group: its help, as before
                raise
            # pydantic's prefix on a bad choice says nothing to a user of the command line.
            message = " ".join(error.format_message().replace("Value error, ", "").split())
            where = f" (see `{error.ctx.command_path} --help`)" if error.ctx is not None else ""
            typer.echo(f"error: {message}{where}", err=True)
            ctx.exit(2)


#: What the tool does today: every command, named by what it is for (a test holds it to the commands).
DESCRIPTION = (
    "Improved clustered attention (Vyas et al., 2020) for pretrained BERT-family models. Measure: "
    "evaluate scores a model unmodified and with clustered attention on GLUE, SQuAD and retrieval tasks; "
    "tune finds the cheapest settings within a score budget; inspect shows each layer's and head's error."
    " Make models: convert saves a checkpoint with clustered attention; finetune trains one with "
    "clustered attention in the loop (from a checkpoint, or from a model config for masked-LM "
    "pretraining). Embed: embed writes a corpus's embeddings to parquet shards; serve answers embedding "
    "requests over HTTP. Tasks: ls lists them, validate checks their YAML. Environment: info (or env) "
    "reports versions and backends; kernels builds the C++/CUDA kernels."
)

app = typer.Typer(
    cls=_OneLineUsageErrors,
    name="bert-cluster",
    help=DESCRIPTION,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
kernels_app = typer.Typer(help="Build and inspect the C++/CUDA kernels.", no_args_is_help=True)
app.add_typer(kernels_app, name="kernels")

stdout = Console()
stderr = Console(stderr=True)

#: The choices, as enums so that --help lists them (taken from config.py: a new mode appears by itself).
Mode = enum.Enum("Mode", {name: name for name in MODES}, type=str)
Backend = enum.Enum("Backend", {name: name for name in BACKENDS}, type=str)
#: The presets, for the help texts only: each command reads its preset when it runs (convert and embed
#: ``for_convert()``; evaluate, tune and inspect ``for_evaluation()``).
_DEFAULTS = ClusteredAttentionConfig.for_evaluation()


def _int_or_word(text: str) -> int | str:
    """``12`` -> 12; a word (such as ``auto``) is passed on for the config to accept or refuse."""
    return int(text) if text.strip().lstrip("-").isdigit() else text.strip()


# Every option that two commands share is declared here, once: one name, one type and one help text
# that reads right for each command using it (tests/test_cli_declared_once.py walks the app to keep it so).
# A command that needs another default gives it as its parameter's default (``batch_size: BatchSizeOpt
# = 16``); what a command writes into OUT is in its own description.

#: --topk and --layers: one value for the commands that patch a model, several (and search) for tune.
TopkOpt = Annotated[
    str | None,
    typer.Option(
        "--topk",
        metavar="K[,K...]",
        help=f"Keys per cluster recomputed exactly (default {_DEFAULTS.topk}); tune takes several "
        "(default 16,32,64).",
    ),
]
LayersOpt = Annotated[
    str | None,
    typer.Option(
        "--layers",
        help="Attention layers to patch: all (the default) or indices such as 0,1,2; tune also takes search "
        "(its default: all, and patching only the first or last layers).",
    ),
]

#: One option per ClusteredAttentionConfig setting that every command of attention shares (clusters,
#: mode and seed differ: evaluate sweeps them). A new setting is one line here.
ATTENTION_OPTIONS: dict[str, Any] = {
    "topk": TopkOpt,
    "bits": Annotated[
        int | None, typer.Option("--bits", help=f"Hash bits per query, 1..63 (default {_DEFAULTS.bits}).")
    ],
    "iterations": Annotated[
        int | None,
        typer.Option(
            "--iterations", help=f"Lloyd iterations of Hamming K-means (default {_DEFAULTS.iterations})."
        ),
    ],
    "min_length": Annotated[
        str | None,
        typer.Option(
            "--min-length",
            parser=_int_or_word,
            help="Rows shorter than this use exact attention: an int, or auto (the measured crossover: "
            "convert's, embed's and serve's default); evaluate, tune, inspect and finetune default to 0 "
            "(every row approximated).",
        ),
    ],
    "cluster_growth": Annotated[
        float | None,
        typer.Option(
            "--cluster-growth",
            help="Rows of n > 512 tokens use C * (n / 512) ** this clusters; 0 keeps C fixed "
            f"(default {_DEFAULTS.cluster_growth}).",
        ),
    ],
    "topk_growth": Annotated[
        float | None,
        typer.Option("--topk-growth", help=f"The same for topk (default {_DEFAULTS.topk_growth})."),
    ],
    "layers": LayersOpt,
    "backend": Annotated[Backend | None, typer.Option("--backend", help="Attention kernels (default auto).")],
}


def attention_options(command: Callable[..., None] | None = None, *, exclude: tuple[str, ...] = ()) -> Any:
    """Give ``command`` one option per ``ATTENTION_OPTIONS`` entry; those given arrive as ``attention``.

    ``@attention_options(exclude=("topk",))``: all but those (a command that takes them its own way).
    """
    if command is None:
        return functools.partial(attention_options, exclude=exclude)
    options = {name: annotation for name, annotation in ATTENTION_OPTIONS.items() if name not in exclude}
    signature = inspect.signature(command, eval_str=True)
    kept = [parameter for parameter in signature.parameters.values() if parameter.name != "attention"]
    added = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation)
        for name, annotation in options.items()
    ]

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        given = {name: kwargs.pop(name, None) for name in options}
        with user_errors():
            settings = _attention_settings(given)
        return command(*args, attention=settings, **kwargs)

    wrapper.__signature__ = signature.replace(parameters=[*kept, *added])  # type: ignore[attr-defined]
    return wrapper


def _attention_settings(given: dict[str, Any]) -> dict[str, Any]:
    """The config settings of the attention options given: choices as their values, --topk and --layers read.

    Raises:
        UserError: several k or search in --layers (only tune searches), or a malformed --topk or --layers.
    """
    from bert_cluster.errors import UserError

    settings = {name: getattr(value, "value", value) for name, value in given.items() if value is not None}
    if "topk" in settings:
        text = settings["topk"]
        if "," in text:
            raise UserError(f"--topk: this command takes one k, got {text} (tune takes several)")
        try:
            settings["topk"] = int(text)
        except ValueError:
            raise UserError(f"--topk takes an int, got {text!r}") from None
    if "layers" in settings:
        layers = _layers(settings["layers"], words=("all",))
        settings["layers"] = None if layers == "all" else layers
    return settings


def _layers(text: str, words: tuple[str, ...]) -> str | tuple[int, ...]:
    """--layers as one of ``words`` (all; search for tune) or a tuple of layer indices.

    Raises:
        UserError: neither one of ``words`` nor non-negative ints separated by commas.
    """
    from bert_cluster.errors import UserError

    text = text.strip()
    if text in words:
        return text
    if text == "search":
        raise UserError("--layers search: only tune searches layers; give all or indices such as 0,1,2")
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isdigit() for part in parts):
        raise UserError(
            f"--layers: malformed layer list {text!r}: give non-negative ints separated by commas, or "
            + " or ".join(words)
        )
    return tuple(int(part) for part in parts)


# A command that takes one C, mode and seed gets the same options as one that sweeps them, and refuses
# several in one line (``_one_config``); an option left out is None, and the command reads the value
# from its preset.
ClustersOpt = Annotated[
    str | None,
    typer.Option(
        "--clusters",
        "-c",
        metavar="C[,C...]",
        help=f"Cluster count C (default {_DEFAULTS.clusters}); evaluate and tune take several: 10,25,50 "
        "(tune's default 10,25,50,100).",
    ),
]
ModeOpt = Annotated[
    list[Mode] | None,
    typer.Option(
        "--mode",
        help=f"Attention mode (default {_DEFAULTS.mode}); evaluate and tune take it repeated (tune's "
        "default: every mode).",
    ),
]
SeedOpt = Annotated[
    int | None,
    typer.Option(
        "--seed",
        help=f"Seed of the hash planes (default {_DEFAULTS.seed}); finetune's seeds the data order, new "
        "weights and dropout too.",
    ),
]
SeedsOpt = Annotated[
    int | None,
    typer.Option(
        "--seeds",
        help="Seeds 0..N-1 per setting (default 1): evaluate scores each C and mode with each, tune "
        "averages each candidate over them.",
    ),
]
ExactOpt = Annotated[
    bool, typer.Option("--exact", help="The unmodified model, without clustered attention (the control).")
]
TaskOpt = Annotated[
    str | None,
    typer.Option(
        "--task",
        "-t",
        help="Task name (bert-cluster ls lists them); evaluate takes several, comma-separated.",
    ),
]
DataDirOpt = Annotated[
    list[Path] | None,
    typer.Option(
        "--data-dir", help="Folder with the tasks' files (searched one level down too); repeatable."
    ),
]
LimitOpt = Annotated[
    int | None,
    typer.Option(
        "--limit",
        help="Only the first N examples of each task (retrieval: N questions, the corpus cut in "
        "proportion; inspect: N inputs of --file or --task).",
    ),
]
MaxLengthOpt = Annotated[
    int | None,
    typer.Option(
        "--max-length",
        help="Truncation length in tokens; by default the task's (embed: the model's positions; "
        "inspect: 512).",
    ),
]
BatchSizeOpt = Annotated[
    int | None,
    typer.Option(
        "--batch-size",
        help="Examples (SQuAD: windows) per batch; by default the task's (finetune: 16 per optimizer step).",
    ),
]
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu, cuda or cuda:N.")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="float32 or bfloat16.")]
OutputOpt = Annotated[
    Path | None,
    typer.Option("--output", "-o", metavar="OUT", help="Folder for the files the description above lists."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON for machines instead of tables.")]
OverwriteOpt = Annotated[
    bool,
    typer.Option(
        "--overwrite",
        help="Write into a folder that is not empty, replacing only the files an earlier run wrote there "
        "(embed refuses a folder that holds any other file).",
    ),
]
QuietOpt = Annotated[
    bool, typer.Option("--quiet", "-q", help="No progress and no notes: results and errors only.")
]


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn a user mistake into one line on stderr and exit code 2; Ctrl-C into one line and exit 130."""
    from bert_cluster.errors import UserError, one_line
    from bert_cluster.evaluation.runner import RunInterrupted

    try:
        yield
    except (UserError, ValueError, TypeError) as error:
        message = (
            one_line(error) if isinstance(error, UserError) else f"{type(error).__name__}: {one_line(error)}"
        )
        stderr.print(f"error: {message}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    except RunInterrupted as interrupted:
        where = (
            f"partial results in {interrupted.written}"
            if interrupted.written
            else "nothing written (no --output)"
        )
        unfinished = [task.task for task in interrupted.results.tasks if task.status == "interrupted"]
        marked = f"; task {', '.join(unfinished)} marked interrupted" if unfinished else ""
        stderr.print(f"interrupted: {where}{marked}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(130) from None


def _version(value: bool) -> None:
    if value:
        print(f"bert-cluster {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """The options before a command (--version); the commands are in DESCRIPTION."""


@app.command()
@attention_options
def evaluate(
    model: Annotated[
        str | None,
        typer.Argument(
            help="Hub id, local folder or package:NAME ({task} becomes each task's name). Omit: the demo."
        ),
    ] = None,
    task: TaskOpt = None,
    clusters: ClustersOpt = None,
    mode: ModeOpt = None,
    seeds: SeedsOpt = None,
    data_dir: DataDirOpt = None,
    max_length: MaxLengthOpt = None,
    batch_size: BatchSizeOpt = None,
    device: DeviceOpt = "cpu",
    limit: LimitOpt = None,
    output: OutputOpt = None,
    overwrite: OverwriteOpt = False,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
    attention: dict[str, Any] | None = None,
) -> None:
    """Score MODEL unmodified and with clustered attention in each configuration, on each task.

    OUT: results.json, results.md and scores.png.
    """
    from bert_cluster import evaluation
    from bert_cluster.parallel import is_main_process
    from bert_cluster.render import progress_reporter, results_table

    quiet = quiet or not is_main_process()  # launched processes: only the first one speaks
    reporter = None if quiet or as_json else progress_reporter(stderr)
    with user_errors():
        if model is None and not (quiet or as_json):
            description = evaluation.default_run().get("description", "demo")
            stderr.print(
                f"No MODEL given: the embedded default ({description}); flags override it.", highlight=False
            )
        results = evaluation.run(
            model,
            tasks=task,
            clusters=clusters,
            mode=[item.value for item in mode] if mode else None,
            seeds=seeds,
            attention=attention,
            data_dir=list(data_dir) if data_dir else None,
            max_length=max_length,
            batch_size=batch_size,
            device=device,
            limit=limit,
            output=output,
            overwrite=overwrite,
            reporter=reporter,
        )
    if not is_main_process():
        raise typer.Exit(0 if results.ok else 2)
    if as_json:
        print(json.dumps(results.to_dict(), indent=2))
    else:
        stdout.print(results_table(results))
        if not quiet:
            for result in results.tasks:
                if result.ok:
                    stdout.print(
                        f"{result.task}: read {result.source} ({result.examples} examples)", highlight=False
                    )
            if output is not None:
                stdout.print(f"wrote {output}/results.json, results.md and scores.png", highlight=False)
    for result in results.failed:
        stderr.print(
            f"error: task {result.task}: {result.error}", markup=False, highlight=False, soft_wrap=True
        )
    if not results.ok:
        raise typer.Exit(2)


@app.command()
@attention_options
def convert(
    model: Annotated[str, typer.Argument(help="Hub id or local checkpoint folder.")],
    output: Annotated[Path, typer.Argument(help="Folder to save the patched checkpoint to.")],
    clusters: ClustersOpt = None,
    mode: ModeOpt = None,
    seed: SeedOpt = None,
    overwrite: OverwriteOpt = False,
    attention: dict[str, Any] | None = None,
) -> None:
    """Save a checkpoint patched with clustered attention (import bert_cluster re-applies it on load)."""
    from bert_cluster.checkpoints import convert_checkpoint

    with user_errors():
        config = _one_config(ClusteredAttentionConfig.for_convert(), attention, clusters, mode, seed)
        saved = convert_checkpoint(model, output, config, overwrite=overwrite)
    stdout.print(
        f"saved {saved} ({config.mode}, C={config.clusters}, topk={config.topk}, seed={config.seed})",
        highlight=False,
    )


def _one_config(
    preset: ClusteredAttentionConfig,
    attention: dict[str, Any] | None,
    clusters: str | None,
    mode: list[Mode] | None,
    seed: int | None,
) -> ClusteredAttentionConfig:
    """The config of a command that takes one C, mode and seed: ``preset`` with the options given.

    Raises:
        UserError: a malformed --clusters, several cluster counts or modes, or a setting out of range.
    """
    from bert_cluster.errors import UserError, parse_clusters

    settings = dict(attention or {})
    if clusters is not None:
        counts = parse_clusters(clusters)
        if len(counts) > 1:
            raise UserError(f"--clusters: this command takes one cluster count C, got {clusters}")
        settings["clusters"] = counts[0]
    if mode:
        if len(mode) > 1:
            raise UserError(f"--mode: this command takes one mode, got {', '.join(m.value for m in mode)}")
        settings["mode"] = mode[0].value
    if seed is not None:
        settings["seed"] = seed
    return preset.replace(**settings)


@app.command()
@attention_options
def embed(
    model: Annotated[
        str, typer.Argument(help="SentenceTransformer or transformers folder, package:NAME or hub id.")
    ],
    input: Annotated[  # noqa: A002 - the command's INPUT
        str,
        typer.Argument(
            help="Text file (one document a line), .jsonl/.json/.csv/.parquet, a datasets folder or name, "
            "or package:squad-articles."
        ),
    ],
    output: OutputOpt,
    text_field: Annotated[
        str | None, typer.Option("--text-field", help="Column of the texts (default text).")
    ] = None,
    id_field: Annotated[
        str | None, typer.Option("--id-field", help="Column of the ids (default: line or row number).")
    ] = None,
    json_field: Annotated[
        str | None, typer.Option("--json-field", help="A .json mapping: the key of its list of records.")
    ] = None,
    split: Annotated[str | None, typer.Option("--split", help="Split of a dataset with several.")] = None,
    exact: ExactOpt = False,
    clusters: ClustersOpt = None,
    mode: ModeOpt = None,
    seed: SeedOpt = None,
    dtype: DtypeOpt = "float32",
    max_length: MaxLengthOpt = None,
    max_tokens_per_batch: Annotated[
        int, typer.Option("--max-tokens-per-batch", help="Padded tokens (rows x longest) per model pass.")
    ] = 16384,
    shard_size: Annotated[int, typer.Option("--shard-size", help="Documents per shard.")] = 10000,
    device: DeviceOpt = "cpu",
    overwrite: OverwriteOpt = False,
    quiet: QuietOpt = False,
    attention: dict[str, Any] | None = None,
) -> None:
    """Embed every document of INPUT into parquet shards; a stopped run continues on the same command.

    OUT: shard-NNNNN.parquet and manifest.json. --overwrite replaces an embed run of other settings there.
    """
    from bert_cluster import embedding
    from bert_cluster.embedding.progress import ProgressBar
    from bert_cluster.parallel import is_main_process

    main_process = is_main_process()
    quiet = quiet or not main_process
    bar = ProgressBar(stderr) if not quiet else None
    with user_errors():
        config = _one_config(ClusteredAttentionConfig.for_convert(), attention, clusters, mode, seed)
        try:
            with bar or contextlib.nullcontext():
                result = embedding.embed(
                    model,
                    input,
                    output,
                    text_field=text_field,
                    id_field=id_field,
                    json_field=json_field,
                    split=split,
                    exact=exact,
                    attention=config,
                    dtype=dtype,
                    max_length=max_length,
                    max_tokens_per_batch=max_tokens_per_batch,
                    shard_size=shard_size,
                    device=device,
                    overwrite=overwrite,
                    progress=bar,
                )
        except embedding.EmbedInterrupted as interrupted:
            stderr.print(f"{interrupted}; run the same command to continue", markup=False, soft_wrap=True)
            raise typer.Exit(130) from None
        except KeyboardInterrupt:
            stderr.print(f"interrupted: run the same command to continue in {output}", markup=False)
            raise typer.Exit(130) from None
    if not main_process:
        return
    # Skipped documents and re-embedded shards are never hidden, -q or not (they are not progress).
    for problem in result.problems:
        stderr.print(
            f"skipped {problem.id or 'a record'} (line {problem.line}): {problem.reason}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
    for name, why in result.damaged_shards.items():
        stderr.print(
            f"re-embedded {name}: it was damaged ({why})", markup=False, highlight=False, soft_wrap=True
        )
    if quiet:
        return
    rate = (
        f", {result.documents_per_second:,.1f} docs/s, {result.tokens_per_second:,.0f} tokens/s"
        if result.documents_per_second
        else ""
    )
    stdout.print(
        f"embedded {result.documents:,} documents ({result.truncated:,} truncated at "
        f"{result.manifest['settings']['max_length']} tokens, {len(result.problems)} skipped) into "
        f"{result.shards} shard(s) in {output} ({result.resumed_shards} resumed{rate})",
        highlight=False,
        soft_wrap=True,
    )


@app.command()
@attention_options
def serve(
    model: Annotated[
        str, typer.Argument(help="SentenceTransformer or transformers folder, package:NAME or hub id.")
    ],
    exact: ExactOpt = False,
    clusters: ClustersOpt = None,
    mode: ModeOpt = None,
    seed: SeedOpt = None,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "float32",
    threads: Annotated[
        int | None,
        typer.Option("--threads", help="Torch threads in all (default one per core), split between workers."),
    ] = None,
    host: Annotated[
        str, typer.Option("--host", help="Address to bind (0.0.0.0: every interface; mind --api-key).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port to listen on.")] = 8080,
    workers: Annotated[
        int, typer.Option("--workers", help="Worker processes (each loads the model; stateless replicas).")
    ] = 1,
    model_name: Annotated[
        str | None, typer.Option("--model-name", help="Name answers carry (default: the folder's name).")
    ] = None,
    max_input_tokens: Annotated[
        int | None,
        typer.Option(
            "--max-input-tokens",
            help="Longest input (tokens); longer ones are refused (413) unless the request asks to truncate "
            "(default: the model's positions).",
        ),
    ] = None,
    max_batch_tokens: Annotated[
        int | None,
        typer.Option(
            "--max-batch-tokens",
            help="Padded tokens (inputs x longest) per model pass; at least --max-input-tokens "
            "(default: 16384, or --max-input-tokens if more).",
        ),
    ] = None,
    max_batch_requests: Annotated[
        int, typer.Option("--max-batch-requests", help="Inputs per model pass.")
    ] = ServeSettings.max_batch_requests,
    max_wait_ms: Annotated[
        float, typer.Option("--max-wait-ms", help="Longest wait for more inputs to fill a batch (ms).")
    ] = ServeSettings.max_wait_ms,
    max_client_batch_size: Annotated[
        int, typer.Option("--max-client-batch-size", help="Inputs per request (more: 413).")
    ] = ServeSettings.max_client_batch_size,
    max_concurrent_requests: Annotated[
        int,
        typer.Option("--max-concurrent-requests", help="Requests in flight (more: 429 with Retry-After)."),
    ] = ServeSettings.max_concurrent_requests,
    payload_limit: Annotated[
        int, typer.Option("--payload-limit", help="Largest request body in bytes (more: 413).")
    ] = ServeSettings.payload_limit,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            envvar="BERT_CLUSTER_API_KEY",
            help="Require Authorization: Bearer KEY on every route but /health and /ready.",
        ),
    ] = None,
    cors_origin: Annotated[
        list[str] | None,
        typer.Option("--cors-origin", help="Allow cross-origin requests from this origin; repeatable."),
    ] = None,
    grace_s: Annotated[
        float,
        typer.Option("--grace-s", help="On SIGTERM/SIGINT: seconds the requests in flight get to finish."),
    ] = 30.0,
    warmup: Annotated[
        bool, typer.Option("--warmup/--no-warmup", help="Run the model once before /ready says ready.")
    ] = True,
    interleave: Annotated[
        bool,
        typer.Option(
            "--interleave/--no-interleave",
            help="Run short inputs' batches between the layers of a long one (a query waits for one "
            "layer of a long document, not all of it).",
        ),
    ] = ServeSettings.interleave,
    log_level: Annotated[
        str, typer.Option("--log-level", help="uvicorn's: info, warning, error...")
    ] = "info",
    attention: dict[str, Any] | None = None,
) -> None:
    """Serve sentence embeddings over HTTP: OpenAI /v1/embeddings, TEI /embed, probes, /metrics.

    Stops on SIGTERM or Ctrl-C, letting the requests in flight finish (exit 0). docs/serve.md.
    """
    from bert_cluster import serve as serving
    from bert_cluster.errors import UserError

    with user_errors():
        config = None
        if exact:
            given = [
                name
                for name, value in (("--clusters", clusters), ("--mode", mode), ("--seed", seed))
                if value
            ]
            given += [f"--{name.replace('_', '-')}" for name in attention or {}]
            if given:
                raise UserError(f"--exact serves the unmodified model: drop {', '.join(given)}")
        else:
            config = _one_config(ClusteredAttentionConfig.for_convert(), attention, clusters, mode, seed)
        settings = serving.ServeSettings(
            model=model,
            exact=exact,
            attention=config,
            device=device,
            dtype=dtype,
            threads=threads,
            model_name=model_name,
            max_input_tokens=max_input_tokens,
            max_batch_tokens=max_batch_tokens,
            max_batch_requests=max_batch_requests,
            max_wait_ms=max_wait_ms,
            max_client_batch_size=max_client_batch_size,
            max_concurrent_requests=max_concurrent_requests,
            payload_limit=payload_limit,
            api_key=api_key,
            cors_origins=tuple(cors_origin or ()),
            warmup=warmup,
            interleave=interleave,
        )
        serving.run_server(
            settings, host=host, port=port, workers=workers, grace_s=grace_s, log_level=log_level.lower()
        )


def _screen(text: str) -> int | str | None:
    text = text.strip()
    if text in ("auto", "off", "0"):
        return {"auto": "auto", "off": None, "0": None}[text]
    if not text.isdigit():
        raise typer.BadParameter(f"give auto, off or a number of examples, got {text!r}")
    return int(text)


Cost = enum.Enum("Cost", {"speed": "speed", "attention": "attention"}, type=str)


@app.command()
@attention_options(exclude=("topk", "layers"))
def tune(
    model: Annotated[str, typer.Argument(help="Hub id, local folder or package:NAME.")],
    task: TaskOpt,
    budget: Annotated[
        float,
        typer.Option("--budget", help="Largest score drop allowed, in points of every judged metric."),
    ] = 0.5,
    clusters: ClustersOpt = None,
    topk: TopkOpt = None,
    mode: ModeOpt = None,
    layers: LayersOpt = "search",
    metric: Annotated[
        list[str] | None,
        typer.Option("--metric", help="Metric judged against the budget; repeatable (default: all)."),
    ] = None,
    seeds: SeedsOpt = 1,
    cost: Annotated[
        Cost,
        typer.Option(
            "--cost",
            help="What cheapest means: attention = lowest modeled attention work, per query (C + k) / n "
            "averaged over layers, exact layers 1 (n: the slice's mean row length; the same on any "
            "machine); speed = highest speedup measured on the slice (noisy on a busy machine).",
        ),
    ] = Cost.attention,
    screen: Annotated[
        str,
        typer.Option(
            "--screen",
            parser=_screen,
            help="Score each candidate on the first N examples first and drop it when far out of budget: "
            "auto (a quarter of a slice of >= 200), off, or N.",
        ),
    ] = "auto",
    screen_margin: Annotated[
        float,
        typer.Option(
            "--screen-margin",
            help="Dropped on screening when more than budget + max(this, 300 / N) points down "
            "(N: screening examples; 300 / N is three examples' worth).",
        ),
    ] = 2.0,
    data_dir: DataDirOpt = None,
    limit: LimitOpt = None,
    max_length: MaxLengthOpt = None,
    batch_size: BatchSizeOpt = None,
    device: DeviceOpt = "cpu",
    output: OutputOpt = None,
    save_model: Annotated[
        Path | None,
        typer.Option("--save-model", help="Save the checkpoint converted with the chosen settings here."),
    ] = None,
    overwrite: OverwriteOpt = False,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
    attention: dict[str, Any] | None = None,
) -> None:
    """Find the cheapest settings (C, k, mode, layers) whose score stays within --budget of unmodified.

    Cheapest: the lowest modeled attention work (--cost attention, the default: per query (C + k) / n,
    averaged over layers) or the highest measured speedup (--cost speed). The search assumes more
    clusters, more keys and fewer patched layers never score worse: over C it stops at the first C
    that fails, going down. The grid: --clusters (default 10,25,50,100), --topk (default 16,32,64) and
    --mode (default every mode), scored on the task's dev split (--limit N: its first N examples).

    OUT: tune.json, tune.md, tune.png and clustered-attention.json.
    """
    from bert_cluster import evaluation
    from bert_cluster.parallel import is_main_process
    from bert_cluster.render import CandidateLines, progress_reporter, tune_table

    quiet = quiet or not is_main_process()
    reporter = None if quiet or as_json else CandidateLines(progress_reporter(stderr), stderr)
    with user_errors():
        chosen_layers = _layers(layers or "search", words=("search", "all"))
        try:
            result = evaluation.tune(
                model,
                task,
                budget,
                clusters=clusters,
                topk=topk,
                modes=[item.value for item in mode] if mode else None,
                layers=chosen_layers,
                metric=metric or None,
                seeds=seeds,
                cost=cost.value,
                screen=screen,
                screen_margin=screen_margin,
                attention=attention,
                data_dir=list(data_dir) if data_dir else None,
                limit=limit,
                batch_size=batch_size,
                max_length=max_length,
                device=device,
                output=output,
                save_model=save_model,
                overwrite=overwrite,
                reporter=reporter,
            )
        except evaluation.TuneInterrupted as interrupted:
            where = f"partial results in {interrupted.written}" if interrupted.written else "nothing written"
            done = len(interrupted.result.candidates)
            stderr.print(f"interrupted: {done} candidate(s) scored; {where}", markup=False, highlight=False)
            raise typer.Exit(130) from None
    if not is_main_process():
        return
    if as_json:
        print(json.dumps(result.to_dict(), indent=2))
        return
    stdout.print(tune_table(result))
    stdout.print(f"recommendation: {result.recommendation}", highlight=False, soft_wrap=True)
    if not quiet:
        for note in result.notes:
            stdout.print(f"note: {note}", highlight=False, soft_wrap=True)
        if output is not None:
            saved = " and clustered-attention.json" if result.config is not None else ""
            stdout.print(f"wrote {output}/tune.json, tune.md, tune.png{saved}", highlight=False)
        if save_model is not None:
            stdout.print(
                f"saved {save_model}"
                if result.config is not None
                else "nothing saved: no candidate in budget",
                highlight=False,
            )


@app.command()
@attention_options
def finetune(
    model: Annotated[str, typer.Argument(help="Hub id, local folder or package:NAME (any head, or none).")],
    task: TaskOpt,
    output: OutputOpt,
    clusters: ClustersOpt = None,
    mode: ModeOpt = None,
    exact: ExactOpt = False,
    lora: Annotated[
        bool,
        typer.Option(
            "--lora",
            help="LoRA on the encoder's Linear layers, head trained fully (needs peft: the finetune "
            "extra of bert-cluster, or pip install peft); the default where the task trains a head.",
        ),
    ] = False,
    full: Annotated[bool, typer.Option("--full", help="Train every weight instead of LoRA.")] = False,
    lora_rank: Annotated[int, typer.Option("--lora-rank", help="LoRA rank.")] = 16,
    lora_alpha: Annotated[int, typer.Option("--lora-alpha", help="LoRA alpha.")] = 32,
    epochs: Annotated[
        float | None, typer.Option("--epochs", help="Passes over the train split (default 3).")
    ] = None,
    max_steps: Annotated[
        int | None, typer.Option("--max-steps", help="Optimizer steps, instead of --epochs.")
    ] = None,
    learning_rate: Annotated[
        float | None,
        typer.Option(
            "--learning-rate",
            "--lr",
            help="Peak learning rate (default 5e-4 LoRA, 1e-4 LoRA distilling, 2e-5 full).",
        ),
    ] = None,
    batch_size: BatchSizeOpt = 16,
    seed: SeedOpt = 0,
    bf16: Annotated[bool, typer.Option("--bf16", help="Train under bf16 autocast.")] = False,
    save_steps: Annotated[
        int, typer.Option("--save-steps", help="A checkpoint every N steps (OUT/checkpoints).")
    ] = 500,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue the run in OUT from its last complete checkpoint.")
    ] = False,
    overwrite: OverwriteOpt = False,
    data_dir: DataDirOpt = None,
    max_length: MaxLengthOpt = None,
    limit: LimitOpt = None,
    device: DeviceOpt = "cpu",
    distill: Annotated[
        float,
        typer.Option(
            "--distill",
            help="Weight (0-1) of the distance to the checkpoint's own outputs with its original attention "
            "in the loss; 1: trained towards them alone, not the labels (docs/finetune.md).",
        ),
    ] = 0.0,
    distill_temperature: Annotated[
        float, typer.Option("--distill-temperature", help="Softmax temperature of that distance.")
    ] = 1.0,
    attention_dropout: Annotated[
        float | None,
        typer.Option(
            "--attention-dropout", help="The model's attention dropout while training (default its config's)."
        ),
    ] = None,
    max_seconds: Annotated[
        float | None,
        typer.Option(
            "--max-seconds", help="Train for this many seconds of training time (scoring excluded)."
        ),
    ] = None,
    eval_at: Annotated[
        str | None,
        typer.Option(
            "--eval-at",
            help="Seconds of training time at which the task's held-out split is scored, e.g. 0,300,600.",
        ),
    ] = None,
    eval_limit: Annotated[
        int | None, typer.Option("--eval-limit", help="Score N held-out examples at each mark.")
    ] = None,
    eval_exact: Annotated[
        bool, typer.Option("--eval-exact", help="At each mark, also score with exact attention.")
    ] = False,
    warmup_steps: Annotated[int, typer.Option("--warmup-steps", help="Steps of learning-rate warm-up.")] = 0,
    schedule: Annotated[
        str | None,
        typer.Option(
            "--schedule",
            help="Learning rate after the warm-up: linear (to 0) or constant (default with --max-seconds).",
        ),
    ] = None,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
    attention: dict[str, Any] | None = None,
) -> None:
    """Fine-tune MODEL on a task's train split with clustered attention in the loop (docs/finetune.md).

    MODEL may be a model config .json (random weights: masked-LM pretraining, e.g.
    configs/models/byte_bert_4k.json --task sympy-mlm).

    OUT: the fine-tuned checkpoint (converted: bert-cluster evaluate OUT scores it), finetune.json,
    finetune.md, loss.png and checkpoints/. After Ctrl-C or a kill, the same command with --resume
    continues from the last checkpoint.
    """
    from bert_cluster.errors import UserError

    reporter = None
    if not (quiet or as_json):
        from bert_cluster.render import progress_reporter

        reporter = progress_reporter(stderr)
    with user_errors():
        if lora and full:
            raise UserError("give --lora (the default) or --full (every weight), not both")
        config = None
        if exact:
            given = [name for name, value in (("--clusters", clusters), ("--mode", mode)) if value]
            given += [f"--{name.replace('_', '-')}" for name in attention or {}]
            if given:
                raise UserError(f"--exact trains with the unmodified attention: drop {', '.join(given)}")
        else:
            config = _one_config(ClusteredAttentionConfig.for_evaluation(), attention, clusters, mode, seed)
        from bert_cluster.finetuning import FinetuneInterrupted
        from bert_cluster.finetuning import finetune as run_finetune

        try:
            result = run_finetune(
                model,
                task,
                output,
                attention=config,
                exact=exact,
                lora=False if full else (True if lora else None),
                lora_rank=lora_rank,
                lora_alpha=lora_alpha,
                epochs=epochs,
                max_steps=max_steps,
                learning_rate=learning_rate,
                batch_size=batch_size,
                seed=seed,
                bf16=bf16,
                save_steps=save_steps,
                resume=resume,
                overwrite=overwrite,
                data_dir=list(data_dir) if data_dir else None,
                max_length=max_length,
                limit=limit,
                device=device,
                distill=distill,
                distill_temperature=distill_temperature,
                attention_dropout=attention_dropout,
                max_seconds=max_seconds,
                eval_at=_marks(eval_at),
                eval_limit=eval_limit,
                eval_exact=eval_exact,
                warmup_steps=warmup_steps,
                schedule=schedule,
                reporter=reporter,
            )
        except FinetuneInterrupted as interrupted:
            where = (
                f"last checkpoint {interrupted.checkpoint}; continue with the same command and --resume"
                if interrupted.checkpoint
                else "no checkpoint was written yet"
            )
            stderr.print(f"interrupted: {where}", markup=False, highlight=False, soft_wrap=True)
            raise typer.Exit(130) from None
    for name, why in result.skipped_checkpoints.items():  # never hidden, -q or not
        stderr.print(f"skipped {name}: it is damaged ({why})", markup=False, highlight=False, soft_wrap=True)
    if result.already_finished:
        stderr.print(f"{result.output} holds a finished run: nothing changed", markup=False, soft_wrap=True)
    if as_json:
        print(json.dumps(result.to_dict(), indent=2))
        return
    last = result.loss_curve[-1]["loss"] if result.loss_curve else float("nan")
    stdout.print(
        f"{'finished already:' if result.already_finished else 'saved'} {result.output} ({result.steps} "
        f"steps, last loss {last:.4f}); score it with: bert-cluster evaluate {result.output} --task "
        f"{result.settings['task']}",
        highlight=False,
        soft_wrap=True,
    )


def _marks(text: str | None) -> list[float]:
    """``--eval-at 0,300,600`` as seconds."""
    from bert_cluster.errors import UserError

    if not text:
        return []
    try:
        return [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UserError(
            f"--eval-at takes seconds separated by commas, e.g. 0,300,600; got {text!r}"
        ) from None


@app.command()
def info(as_json: JsonOpt = False) -> None:
    """Versions, kernel build status and each backend's availability."""
    import bert_cluster

    data = bert_cluster.info()
    if as_json:
        print(json.dumps(data, indent=2, default=str))
        return
    table = Table(title="bert-cluster environment", show_header=False)
    table.add_column("key")
    table.add_column("value")
    for key, value in data.items():
        table.add_row(
            str(key), json.dumps(value, default=str) if isinstance(value, (dict, list)) else str(value)
        )
    stdout.print(table)


app.command("env", help="Same as info.")(info)


@kernels_app.command("build")
def kernels_build(
    cuda: Annotated[bool, typer.Option("--cuda/--no-cuda", help="Build the CUDA kernels too.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show compiler output.")] = False,
) -> None:
    """Compile the C++ (and optionally CUDA) kernels for the installed torch."""
    from bert_cluster.errors import UserError

    with user_errors():
        try:
            from bert_cluster._build import build_kernels
        except ImportError as error:
            raise UserError(
                f"kernel building is not available in this version (bert_cluster._build: {error})"
            ) from None
        result = build_kernels(cuda=cuda, verbose=verbose)
    if result is not None:
        stdout.print(
            result if isinstance(result, str) else json.dumps(result, indent=2, default=str), highlight=False
        )


@app.command("ls")
def list_tasks(as_json: JsonOpt = False) -> None:
    """List the tasks (configs/tasks/**/*.yaml); files that do not load are named on stderr."""
    from bert_cluster.tasks.config import load_catalog

    with user_errors():
        catalog = load_catalog()
    for problem in catalog.problems:
        stderr.print(f"warning: {problem}", markup=False, highlight=False, soft_wrap=True)
    if as_json:
        print(json.dumps([task.to_dict() for task in catalog.tasks.values()], indent=2))
        return
    table = Table(title="tasks")
    for name in ("task", "kind", "metrics", "description"):
        table.add_column(name)
    for task in catalog.tasks.values():
        table.add_row(task.name, task.kind, ", ".join(m.display for m in task.metrics), task.description)
    stdout.print(table)


@app.command()
def validate(
    paths: Annotated[
        list[Path] | None, typer.Argument(help="Task YAML files (default: all in configs/tasks).")
    ] = None,
) -> None:
    """Check task YAML files: each must load into a TaskConfig its kind accepts (fields, options, metrics)."""
    from bert_cluster.errors import UserError
    from bert_cluster.tasks.config import load_catalog, load_task_file
    from bert_cluster.tasks.kinds import get_kind

    problems: list[str] = []
    with user_errors():
        if paths:
            tasks = []
            for path in paths:
                try:
                    tasks.append(load_task_file(path))
                except UserError as error:
                    problems.append(str(error))
        else:
            catalog = load_catalog()
            tasks, problems = list(catalog.tasks.values()), list(catalog.problems)
    for task in tasks:
        try:
            get_kind(task)
        except UserError as error:
            problems.append(f"{task.source}: {error}")
    for problem in problems:
        stderr.print(f"error: {problem}", markup=False, highlight=False, soft_wrap=True)
    if problems:
        raise typer.Exit(2)
    stdout.print(f"{len(tasks)} task file(s) valid", highlight=False)


@app.command("inspect")
@attention_options
def inspect_command(
    model: Annotated[str, typer.Argument(help="Hub id or local checkpoint folder (any head).")],
    text: Annotated[
        list[str] | None, typer.Option("--text", help="A text to run through the model; repeatable.")
    ] = None,
    file: Annotated[
        Path | None, typer.Option("--file", help="A text file: one input per non-empty line.")
    ] = None,
    task: TaskOpt = None,
    data_dir: DataDirOpt = None,
    limit: LimitOpt = 16,
    clusters: ClustersOpt = None,
    mode: ModeOpt = None,
    seed: SeedOpt = None,
    max_length: MaxLengthOpt = 512,
    max_error: Annotated[
        float, typer.Option("--max-error", help="Per-layer error budget for the suggested layers=.")
    ] = DEFAULT_MAX_ERROR,
    per_head: Annotated[bool, typer.Option("--heads", help="Show every head, not only layer means.")] = False,
    output: OutputOpt = None,
    overwrite: OverwriteOpt = False,
    as_json: JsonOpt = False,
    attention: dict[str, Any] | None = None,
) -> None:
    """Per layer and head: relative error against exact attention, top-k mass, cluster sizes.

    The inputs: --text, --file or a task's dev set (--task, its files in --data-dir). OUT: inspect.json,
    inspect.md and inspect.png.
    """
    from bert_cluster.errors import UserError

    with user_errors():
        sources = [name for name, given in (("--text", text), ("--file", file), ("--task", task)) if given]
        if len(sources) != 1:
            raise UserError(
                "give exactly one input source: --text TEXT (repeatable), --file FILE or --task TASK"
                + (f" (got {', '.join(sources)})" if sources else "")
            )
        if limit < 1:
            raise UserError(f"--limit must be a positive number of inputs, got {limit}")
        if not max_error > 0:
            raise UserError(f"--max-error must be positive, got {max_error}")
        from bert_cluster import inspection

        config = _one_config(ClusteredAttentionConfig.for_evaluation(), attention, clusters, mode, seed)
        inputs: Any
        if text:
            inputs, given = list(text), "--text"
        elif file is not None:
            inputs, given = inspection.load_text_file(file, limit), str(file)
        else:
            from bert_cluster.evaluation import load_task_texts  # datasets, pandas: only for --task

            inputs, given = load_task_texts(task, data_dir, limit), f"task {task}"
        # One folder is recorded as before (a string); several, which --data-dir now takes, as a list.
        folders = [str(folder) for folder in data_dir or ()]
        report = inspection.inspect_checkpoint(
            model,
            inputs,
            config,
            max_length=max_length,
            max_error=max_error,
            output=output,
            overwrite=overwrite,
            settings={
                "inputs": given,
                "limit": limit,
                "data_dir": (folders[0] if len(folders) == 1 else folders) or None,
            },
        )
    if as_json:
        print(json.dumps(report.summary(max_error)))
    else:
        from bert_cluster.render import inspection_table

        stdout.print(inspection_table(report, per_head))
        stdout.print(report.advice(max_error), highlight=False)
        if output is not None:
            stdout.print(f"wrote {output}/inspect.json, inspect.md, inspect.png", highlight=False)


def main() -> None:
    """Entry point of the ``bert-cluster`` script and of ``python -m bert_cluster``."""
    app()


if __name__ == "__main__":
    sys.exit(main())
