"""Evaluate a checkpoint unmodified and with clustered attention on GLUE, SQuAD and the demo tasks.

``evaluate`` (also ``run``) is the API the CLI calls: it turns its arguments into a ``RunPlan``, runs
it, optionally writes results.json / results.md / scores.png, and returns the ``Results``.
Called with no model it runs the embedded default, ``configs/eval/default.yaml``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bert_cluster.config import ClusteredAttentionConfig
from bert_cluster.evaluation.errors import UserError
from bert_cluster.evaluation.report import Results, RunResult, TaskResult
from bert_cluster.evaluation.tasks import TaskConfig, config_root, get_tasks, load_tasks

__all__ = [
    "Results",
    "RunResult",
    "TaskConfig",
    "TaskResult",
    "UserError",
    "convert_checkpoint",
    "default_run",
    "evaluate",
    "get_tasks",
    "load_tasks",
    "run",
]

_DEFAULT_KEYS = {
    "model",
    "tasks",
    "clusters",
    "mode",
    "topk",
    "seeds",
    "limit",
    "batch_size",
    "max_length",
    "data_dir",
    "description",
}


def default_run(path: str | Path | None = None) -> dict[str, Any]:
    """The embedded default run (``configs/eval/default.yaml``) as a dict of ``evaluate`` arguments."""
    import yaml

    path = Path(path) if path is not None else config_root() / "eval" / "default.yaml"
    if not path.is_file():
        raise UserError(f"no model given and the embedded default {path} is missing; name a MODEL and --task")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as error:
        raise UserError(f"{path}: not valid YAML: {str(error).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: the default run must be a mapping")
    unknown = sorted(set(raw) - _DEFAULT_KEYS)
    if unknown:
        raise UserError(f"{path}: unknown key(s) {unknown}; allowed: {sorted(_DEFAULT_KEYS)}")
    model = raw.get("model")
    from bert_cluster.evaluation import embedding

    raw["model"] = (
        str(embedding.default_model_path()) if model in (None, "default") else embedding.resolve_model(model)
    )
    return raw


def evaluate(
    model: str | Path | None = None,
    tasks: str | Sequence[str] | None = None,
    clusters: int | str | Sequence[int] | None = None,
    *,
    mode: str | None = None,
    topk: int | None = None,
    seeds: int | Sequence[int] | None = None,
    data_dir: str | Path | Sequence[str | Path] | None = None,
    max_length: int | None = None,
    batch_size: int | None = None,
    device: str = "cpu",
    limit: int | None = None,
    output: str | Path | None = None,
    attention: ClusteredAttentionConfig | None = None,
    reporter: Any = None,
) -> Results:
    """Score ``model`` unmodified and patched with clustered attention at every cluster count.

    Args:
        model: hub id or local folder; ``{task}`` in it is replaced by each task's name (one checkpoint
            per task). None: the embedded default run (its YAML fills every argument left as None).
        tasks: task names (see ``bert-cluster ls``), a list or one comma-separated string.
        clusters: cluster counts C, e.g. ``[10, 25]`` or ``"10,25"`` (default 25).
        mode: ``i-clustered`` (default) or ``clustered``.
        topk: keys recomputed exactly per cluster (i-clustered; default 32).
        seeds: N (seeds 0..N-1, default 1) or explicit seeds; each seeds the hash planes.
        data_dir: folder(s) holding the tasks' files (searched one level down too); None: the hub.
        max_length: truncation length; None: each task's default.
        batch_size: None: each task's default.
        device: ``cpu`` or ``cuda``.
        limit: score only the first N examples of each task.
        output: folder for results.json, results.md and scores.png (None: write nothing).
        attention: base settings (bits, iterations, min_length, layers, backend); ``clusters``, ``seed``
            and, when given, ``mode`` / ``topk`` are set per run.
        reporter: progress callbacks (``runner.Reporter``); None: silent.

    Raises:
        UserError: a mistake in the arguments (unknown task, malformed clusters, missing model path).
            Failures inside one task do not raise: the task is recorded as failed in the results.
    """
    from bert_cluster.evaluation import report, runner
    from bert_cluster.evaluation.data import data_dirs

    if model is None:
        default = default_run()
        default.pop("description", None)
        model = default["model"]
        tasks = tasks if tasks is not None else default.get("tasks")
        clusters = clusters if clusters is not None else default.get("clusters")
        mode = mode if mode is not None else default.get("mode")
        topk = topk if topk is not None else default.get("topk")
        seeds = seeds if seeds is not None else default.get("seeds")
        limit = limit if limit is not None else default.get("limit")
        batch_size = batch_size if batch_size is not None else default.get("batch_size")
        max_length = max_length if max_length is not None else default.get("max_length")
        data_dir = data_dir if data_dir is not None else default.get("data_dir")
    if tasks is None or (not isinstance(tasks, str) and len(tasks) == 0):
        raise UserError("name the task(s) to run, e.g. --task rte,mrpc (bert-cluster ls lists them)")
    for name, value in (
        ("limit", limit),
        ("batch_size", batch_size),
        ("max_length", max_length),
        ("topk", topk),
    ):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise UserError(f"{name} must be a positive int, got {value!r}")
    task_configs = tuple(get_tasks(tasks if isinstance(tasks, str) else list(tasks)))
    base = attention or ClusteredAttentionConfig()
    try:
        base = base.replace(**{k: v for k, v in (("mode", mode), ("topk", topk)) if v is not None})
    except (TypeError, ValueError) as error:
        raise UserError(str(error)) from None
    model_text = str(model)
    from bert_cluster.evaluation.modeling import check_model_path

    for task in task_configs:
        check_model_path(model_text.replace("{task}", task.name))
    plan = runner.RunPlan(
        model=model_text,
        tasks=task_configs,
        clusters=runner.parse_clusters(clusters if clusters is not None else 25),
        seeds=runner.parse_seeds(seeds if seeds is not None else 1),
        attention=base,
        data_dirs=tuple(data_dirs(data_dir)) if data_dir is not None else (),
        limit=limit,
        batch_size=batch_size,
        max_length=max_length,
        device=runner.check_device(device),
    )
    partial = None if output is None else (lambda so_far: report.write(so_far, output))
    results = runner.run_plan(plan, reporter, partial)
    if output is not None:
        report.write(results, output)
    return results


#: The name the style guide's CLI calls (``evaluate.run``).
run = evaluate


def convert_checkpoint(model: str | Path, output: str | Path, config: ClusteredAttentionConfig) -> Path:
    """Load ``model`` with the head its config names, patch it with ``config`` and save it to ``output``.

    The saved config.json carries the clustered-attention settings; ``import bert_cluster`` before
    ``from_pretrained`` re-applies them.
    """
    import bert_cluster
    from bert_cluster.evaluation.modeling import check_model_path, quiet_transformers

    source = check_model_path(model)
    import transformers

    try:
        with quiet_transformers():
            hf_config = transformers.AutoConfig.from_pretrained(source)
            architecture = (hf_config.architectures or ["AutoModel"])[0]
            model_class = getattr(transformers, architecture, transformers.AutoModel)
            loaded = model_class.from_pretrained(source)
            tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, KeyError, TypeError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserError(f"cannot load model {source}: {first}") from None
    try:
        bert_cluster.convert(loaded, config=config)
    except (TypeError, ValueError) as error:
        raise UserError(f"cannot convert {source}: {error}") from None
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    loaded.save_pretrained(output)
    tokenizer.save_pretrained(output)
    return output
