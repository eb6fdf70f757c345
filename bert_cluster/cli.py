"""The ``bert-cluster`` command: a thin shell over ``bert_cluster.evaluation`` and ``bert_cluster.info``.

Each command parses its options, builds the objects the API takes, calls the API and renders the result
with rich. A user mistake (``UserError``, or a ValueError/TypeError from validating settings) becomes
one line on stderr and exit code 2, without a traceback.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(
    name="bert-cluster",
    help="Improved clustered attention for pretrained BERT-family models: evaluate, convert, inspect.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
kernels_app = typer.Typer(help="Build and inspect the C++/CUDA kernels.", no_args_is_help=True)
app.add_typer(kernels_app, name="kernels")

stdout = Console()
stderr = Console(stderr=True)

# Options shared by several commands, declared once.
ClustersOpt = Annotated[
    str, typer.Option("--clusters", "-c", help="Cluster counts C, comma-separated: 10,25,50.")
]
ModeOpt = Annotated[str, typer.Option("--mode", help="i-clustered (improved) or clustered.")]
TopkOpt = Annotated[int, typer.Option("--topk", help="Keys per cluster recomputed exactly (i-clustered).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON for machines instead of tables.")]


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn a user mistake into one line on stderr and exit code 2."""
    from bert_cluster.evaluation.errors import UserError

    try:
        yield
    except (UserError, ValueError, TypeError) as error:
        message = " ".join(str(error).split()) or type(error).__name__
        if not isinstance(error, UserError):
            message = f"{type(error).__name__}: {message}"
        stderr.print(f"error: {message}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None


def results_table(results: Any) -> Table:
    """The summary table: task, metric, unmodified, then each C as mean ± std (delta)."""
    from bert_cluster.evaluation.report import table_rows

    header, rows = table_rows(results)
    seeds = results.settings.get("seeds") or []
    mode = results.settings.get("mode", "")
    title = f"{mode} attention, {len(seeds)} seed(s); patched: mean ± std (Δ unmodified)"
    table = Table(title=title)
    for index, name in enumerate(header):
        table.add_column(name, justify="left" if index < 2 else "right")
    for row in rows:
        table.add_row(*row)
    return table


@app.command()
def evaluate(
    model: Annotated[
        str | None,
        typer.Argument(
            help="Hub id or local folder ({task} becomes each task's name). Omit: the embedded default."
        ),
    ] = None,
    task: Annotated[
        str | None, typer.Option("--task", "-t", help="Tasks, comma-separated (see `ls`).")
    ] = None,
    clusters: Annotated[
        str | None, typer.Option("--clusters", "-c", help="Cluster counts C: 10,25,50.")
    ] = None,
    mode: Annotated[str | None, typer.Option("--mode", help="i-clustered or clustered.")] = None,
    topk: Annotated[int | None, typer.Option("--topk", help="Keys per cluster recomputed exactly.")] = None,
    seeds: Annotated[
        int | None, typer.Option("--seeds", help="Number of seeds (0..N-1) per cluster count.")
    ] = None,
    data_dir: Annotated[
        list[Path] | None,
        typer.Option(
            "--data-dir", help="Folder with the tasks' files (searched one level down too); repeatable."
        ),
    ] = None,
    max_length: Annotated[
        int | None, typer.Option("--max-length", help="Truncation length (tokens).")
    ] = None,
    batch_size: Annotated[int | None, typer.Option("--batch-size", help="Batch size.")] = None,
    device: Annotated[str, typer.Option("--device", help="cpu or cuda.")] = "cpu",
    limit: Annotated[
        int | None,
        typer.Option(
            "--limit",
            help="Score N examples per task: the first N (retrieval: N questions spread over the set).",
        ),
    ] = None,
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="Folder for results.json, results.md and scores.png."),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Score MODEL unmodified and with clustered attention at each cluster count, on each task."""
    from bert_cluster import evaluation
    from bert_cluster.evaluation.runner import LineReporter, RichReporter

    # Progress bars on a terminal; in a log (stdout not a terminal), one line per configuration. Stderr
    # carries only the one-line errors.
    reporter = None
    if not as_json:
        reporter = (
            RichReporter(stderr) if stderr.is_terminal else LineReporter() if not stdout.is_terminal else None
        )
    with user_errors():
        if model is None and not as_json:
            default = evaluation.default_run()
            stderr.print(
                f"No MODEL given: running the embedded default ({default.get('description', 'demo')}); "
                "flags override its settings.",
                highlight=False,
            )
        results = evaluation.run(
            model,
            tasks=task,
            clusters=clusters,
            mode=mode,
            topk=topk,
            seeds=seeds,
            data_dir=list(data_dir) if data_dir else None,
            max_length=max_length,
            batch_size=batch_size,
            device=device,
            limit=limit,
            output=output,
            reporter=reporter,
        )
    if as_json:
        print(json.dumps(results.to_dict(), indent=2))
    else:
        stdout.print(results_table(results))
        for result in results.tasks:
            if result.ok:
                stdout.print(
                    f"{result.task}: read {result.source} ({result.examples} examples)", highlight=False
                )
        if output is not None:
            stdout.print(f"wrote {output}/results.json, results.md, scores.png", highlight=False)
    for result in results.failed:
        stderr.print(
            f"error: task {result.task}: {result.error}", markup=False, highlight=False, soft_wrap=True
        )
    if not results.ok:
        raise typer.Exit(2)


@app.command()
def convert(
    model: Annotated[str, typer.Argument(help="Hub id or local checkpoint folder.")],
    output: Annotated[Path, typer.Argument(help="Folder to save the patched checkpoint to.")],
    clusters: Annotated[int, typer.Option("--clusters", "-c", help="Cluster count C.")] = 25,
    mode: ModeOpt = "i-clustered",
    topk: TopkOpt = 32,
    bits: Annotated[int, typer.Option("--bits", help="Hash bits per query (1..63).")] = 63,
    iterations: Annotated[
        int, typer.Option("--iterations", help="Lloyd iterations of Hamming K-means.")
    ] = 10,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the hash planes.")] = 0,
    min_length: Annotated[int, typer.Option("--min-length", help="Shorter rows use exact attention.")] = 0,
    layers: Annotated[
        str | None, typer.Option("--layers", help="Layer indices to patch: 0,1,2 (default all).")
    ] = None,
    backend: Annotated[str, typer.Option("--backend", help="auto, cpu, cuda or reference.")] = "auto",
) -> None:
    """Save a checkpoint patched with clustered attention (``import bert_cluster`` re-applies it on load)."""
    from bert_cluster import evaluation
    from bert_cluster.config import ClusteredAttentionConfig
    from bert_cluster.evaluation.errors import UserError

    with user_errors():
        layer_list = None
        if layers is not None:
            parts = [part.strip() for part in layers.split(",")]
            if not parts or not all(part.isdigit() for part in parts):
                raise UserError(
                    f"malformed layer list {layers!r}: give non-negative ints separated by commas"
                )
            layer_list = tuple(int(part) for part in parts)
        config = ClusteredAttentionConfig(
            clusters=clusters,
            topk=topk,
            bits=bits,
            iterations=iterations,
            mode=mode,
            min_length=min_length,
            seed=seed,
            layers=layer_list,
            backend=backend,
        )
        saved = evaluation.convert_checkpoint(model, output, config)
    stdout.print(
        f"saved {saved} ({config.mode}, C={config.clusters}, topk={config.topk}, seed={config.seed})",
        highlight=False,
    )


def _build_info() -> dict[str, Any]:
    from bert_cluster.evaluation.errors import UserError

    try:
        from bert_cluster._loader import build_info
    except ImportError as error:
        raise UserError(
            f"build information is not available in this version (bert_cluster._loader: {error})"
        ) from None
    return build_info()


@app.command()
def info(as_json: JsonOpt = False) -> None:
    """Versions, kernel build status and each backend's availability."""
    with user_errors():
        data = _build_info()
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


app.command("env", help="Same as `info`.")(info)


@kernels_app.command("build")
def kernels_build(
    cuda: Annotated[bool, typer.Option("--cuda/--no-cuda", help="Build the CUDA kernels too.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show compiler output.")] = False,
) -> None:
    """Compile the C++ (and optionally CUDA) kernels for the installed torch."""
    from bert_cluster.evaluation.errors import UserError

    with user_errors():
        try:
            from bert_cluster._loader import build_kernels
        except ImportError as error:
            raise UserError(
                f"kernel building is not available in this version (bert_cluster._loader: {error})"
            ) from None
        result = build_kernels(cuda=cuda, verbose=verbose)
    if result is not None:
        stdout.print(
            result if isinstance(result, str) else json.dumps(result, indent=2, default=str), highlight=False
        )


@app.command("ls")
def list_tasks(as_json: JsonOpt = False) -> None:
    """List the tasks (configs/tasks/**/*.yaml)."""
    from bert_cluster.evaluation.tasks import load_tasks

    with user_errors():
        tasks = load_tasks()
    if as_json:
        print(json.dumps([task.to_dict() for task in tasks.values()], indent=2))
        return
    table = Table(title="tasks")
    for column in ("task", "kind", "metrics", "description"):
        table.add_column(column)
    for task in tasks.values():
        table.add_row(task.name, task.kind, ", ".join(m.display for m in task.metrics), task.description)
    stdout.print(table)


@app.command()
def validate(
    paths: Annotated[
        list[Path] | None, typer.Argument(help="Task YAML files (default: all in configs/tasks).")
    ] = None,
) -> None:
    """Check task YAML files: every one must load into a valid TaskConfig with a known kind."""
    from bert_cluster.evaluation.errors import UserError
    from bert_cluster.evaluation.runner import load_kinds
    from bert_cluster.evaluation.tasks import load_task_file, load_tasks, task_files

    kinds = load_kinds()
    files = list(paths) if paths else task_files()
    problems = []
    for path in files:
        try:
            task = load_task_file(path)
            if task.kind not in kinds:
                raise UserError(f"{path}: unknown kind {task.kind!r}; known: {', '.join(sorted(kinds))}")
        except UserError as error:
            problems.append(str(error))
    if not paths:
        try:
            load_tasks()  # also catches duplicated task names
        except UserError as error:
            problems.append(str(error))
    for problem in problems:
        stderr.print(f"error: {problem}", markup=False, highlight=False, soft_wrap=True)
    if problems:
        raise typer.Exit(2)
    stdout.print(f"{len(files)} task file(s) valid", highlight=False)


def main() -> None:
    """Entry point of the ``bert-cluster`` script."""
    app()


if __name__ == "__main__":
    main()


# --- `bert-cluster inspect` (issue 13; w4-fidelity): self-contained, calls bert_cluster.inspect. ---------


@app.command("inspect")
def inspect_command(
    model: Annotated[str, typer.Argument(help="Hub id or local checkpoint folder (any head).")],
    text: Annotated[
        list[str] | None, typer.Option("--text", help="A text to run through the model; repeatable.")
    ] = None,
    file: Annotated[
        Path | None, typer.Option("--file", help="A text file: one input per non-empty line.")
    ] = None,
    task: Annotated[
        str | None, typer.Option("--task", "-t", help="Take the inputs from a task's dev set (see `ls`).")
    ] = None,
    data_dir: Annotated[
        Path | None, typer.Option("--data-dir", help="Folder with the task's files (with --task).")
    ] = None,
    limit: Annotated[int, typer.Option("--limit", help="Inputs taken from --file or --task.")] = 16,
    clusters: Annotated[int, typer.Option("--clusters", "-c", help="Cluster count C.")] = 25,
    mode: Annotated[
        str, typer.Option("--mode", help="i-clustered, i-clustered+ or clustered.")
    ] = "i-clustered",
    topk: TopkOpt = 32,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the hash planes.")] = 0,
    max_length: Annotated[int, typer.Option("--max-length", help="Truncation length (tokens).")] = 512,
    max_error: Annotated[
        float, typer.Option("--max-error", help="Per-layer error budget for the suggested layers=.")
    ] = 0.1,
    per_head: Annotated[bool, typer.Option("--heads", help="Show every head, not only layer means.")] = False,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Folder for inspect.json and inspect.png.")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Per layer and head: relative error against exact attention, top-k mass, cluster sizes."""
    from bert_cluster.evaluation.errors import UserError

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
        from bert_cluster.config import ClusteredAttentionConfig
        from bert_cluster.inspect import inspect_model, load_task_texts

        config = ClusteredAttentionConfig(clusters=clusters, topk=topk, mode=mode, seed=seed)
        inputs: Any
        if text:
            inputs = list(text)
        elif file is not None:
            if not file.is_file():
                raise UserError(f"input file {file} does not exist or is not a file")
            lines = [line.strip() for line in file.read_text(encoding="utf-8").splitlines()]
            inputs = [line for line in lines if line][:limit]
            if not inputs:
                raise UserError(f"input file {file} has no non-empty line")
        else:
            inputs = load_task_texts(task, data_dir, limit)
        loaded, tokenizer = _load_for_inspection(model)
        report = inspect_model(loaded, inputs, tokenizer, config, max_length=max_length)
    suggested = report.suggest_layers(max_error)
    if as_json:
        print(json.dumps({**report.to_dict(), "suggested_layers": list(suggested), "max_error": max_error}))
    else:
        stdout.print(_inspection_table(report, per_head))
        stdout.print(
            f"{report.sequences} sequences, {report.tokens} tokens. Layers with mean relative error <= "
            f"{max_error:g}: {', '.join(map(str, suggested)) or 'none'} "
            f"(convert(..., layers={list(suggested)}))",
            highlight=False,
        )
    if output is not None:
        output.mkdir(parents=True, exist_ok=True)
        data = {
            **report.to_dict(),
            "suggested_layers": list(suggested),
            "max_error": max_error,
            "model": model,
        }
        (output / "inspect.json").write_text(json.dumps(data, indent=2), encoding="utf-8")
        report.heatmap(output / "inspect.png")
        if not as_json:
            stdout.print(f"wrote {output}/inspect.json, inspect.png", highlight=False)


def _load_for_inspection(model: str) -> tuple[Any, Any]:
    """The encoder of any checkpoint (its head is not needed) and its tokenizer; UserError if unreadable."""
    from transformers import AutoModel, AutoTokenizer

    from bert_cluster.evaluation.errors import UserError
    from bert_cluster.evaluation.modeling import check_model_path, quiet_transformers

    source = check_model_path(model)
    try:
        with quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(source)
            loaded = AutoModel.from_pretrained(source)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserError(f"cannot load model {source}: {first}") from None
    return loaded.eval(), tokenizer


def _inspection_table(report: Any, per_head: bool) -> Table:
    c = report.config
    title = f"{c.mode}, C={c.clusters}, k={c.topk}: clustered vs exact attention, per layer" + (
        " and head" if per_head else " (mean over heads)"
    )
    table = Table(title=title)
    columns = ["layer", *(["head"] if per_head else []), "rel. error"]
    columns += [] if per_head else ["worst head"]
    columns += ["top-k mass", "clusters used", "mean size", "largest %"]
    for index, name in enumerate(columns):
        table.add_column(name, justify="left" if index == 0 else "right")

    def mass(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    if per_head:
        for h in report.heads:
            table.add_row(
                str(h.layer),
                str(h.head),
                f"{h.relative_error:.4f}",
                mass(h.topk_mass),
                f"{h.clusters_used:.1f}",
                f"{h.mean_cluster_size:.1f}",
                f"{100 * h.largest_cluster_share:.1f}",
            )
    else:
        for row in report.per_layer():
            table.add_row(
                str(row["layer"]),
                f"{row['relative_error']:.4f}",
                f"{row['worst_head_error']:.4f}",
                mass(row["topk_mass"]),
                f"{row['clusters_used']:.1f}",
                f"{row['mean_cluster_size']:.1f}",
                f"{100 * row['largest_cluster_share']:.1f}",
            )
    return table
