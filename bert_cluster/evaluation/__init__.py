"""Evaluate a checkpoint unmodified and with clustered attention on GLUE, SQuAD and the demo tasks.

``evaluate`` (also ``run``) is the API the CLI calls: it checks every argument before any work, turns
them into a ``RunPlan``, runs it (data-parallel under ``accelerate launch``), optionally writes
results.json / results.md / scores.png, and returns the ``Results``. Called with no model it runs the
embedded default, ``configs/eval/default.yaml``. ``TaskSession`` scores one configuration of one task
at a time (scores and speed); ``tune`` uses it to find the cheapest settings within a score budget.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bert_cluster import config as presets
from bert_cluster.checkpoints import (
    attention_config,
    check_model_path,
    default_model_path,
    max_positions,
    resolve_model,
)
from bert_cluster.config import EVALUATION_SETTINGS, ClusteredAttentionConfig
from bert_cluster.errors import UserError, parse_clusters, positive_int
from bert_cluster.evaluation import report, runner
from bert_cluster.evaluation.report import Results, RunResult, TaskResult
from bert_cluster.evaluation.runner import RunInterrupted, TaskSession
from bert_cluster.evaluation.tuner import Candidate, TuneInterrupted, TuneResult, tune
from bert_cluster.parallel import Workers, check_device
from bert_cluster.reports import check_output
from bert_cluster.tasks.config import TaskConfig, config_root, get_tasks, load_tasks, read_mapping
from bert_cluster.tasks.data import data_dirs, load_task_texts
from bert_cluster.tasks.kinds import get_kind

__all__ = [
    "EVALUATION_DEFAULTS",
    "Candidate",
    "Results",
    "RunInterrupted",
    "RunResult",
    "TaskConfig",
    "TaskResult",
    "TaskSession",
    "TuneInterrupted",
    "TuneResult",
    "UserError",
    "default_run",
    "evaluate",
    "get_tasks",
    "load_task_texts",
    "load_tasks",
    "run",
    "tune",
]

#: Where the evaluator's attention settings differ from the field defaults: its preset,
#: ``ClusteredAttentionConfig.for_evaluation()`` (every row longer than C tokens is approximated).
EVALUATION_DEFAULTS: dict[str, Any] = dict(EVALUATION_SETTINGS)
_ATTENTION_FIELDS = {field.name for field in dataclasses.fields(ClusteredAttentionConfig)}
_DEFAULT_KEYS = {
    "model",
    "tasks",
    "clusters",
    "mode",
    "seeds",
    "limit",
    "batch_size",
    "max_length",
    "data_dir",
}


def default_run(path: str | Path | None = None) -> dict[str, Any]:
    """The embedded default run (``configs/eval/default.yaml``) as a dict of ``evaluate`` arguments.

    Keys naming a ``ClusteredAttentionConfig`` field (``topk``, ``bits``, ...) go to ``attention``.
    """
    path = Path(path) if path is not None else config_root() / "eval" / "default.yaml"
    if not path.is_file():
        raise UserError(f"no model given and the embedded default {path} is missing; name a MODEL and --task")
    raw = read_mapping(path, "the default run", empty=True)
    allowed = _DEFAULT_KEYS | (_ATTENTION_FIELDS - {"mode", "clusters", "seed"}) | {"description"}
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise UserError(f"{path}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")
    model = raw.get("model")
    raw["model"] = str(default_model_path()) if model in (None, "default") else resolve_model(model)
    swept = {"mode", "clusters", "seed"}
    raw["attention"] = {key: raw.pop(key) for key in list(raw) if key in _ATTENTION_FIELDS - swept}
    return raw


def _check_positions(model: str, max_length: int | None, task: TaskConfig) -> None:
    """``max_length`` against a local checkpoint's positions, from its config.json (no model load).

    A kind that scores a model derived from the checkpoint (the long task's position proxy) says how
    many positions that one takes (an optional ``positions(task, checkpoint_positions)`` member).
    """
    config_file = Path(model).expanduser() / "config.json"
    if max_length is None or not config_file.is_file():
        return
    try:
        config = SimpleNamespace(**json.loads(config_file.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        return  # the load itself will say what is wrong with the file
    positions = max_positions(config)
    derived = getattr(get_kind(task), "positions", None)
    if derived is not None:
        positions = derived(task, positions)
    if positions is not None and max_length > positions:
        raise UserError(f"--max-length {max_length} is more than model {model} takes ({positions} positions)")


def _swept(
    attention: ClusteredAttentionConfig | Mapping[str, Any] | None,
    base: ClusteredAttentionConfig,
    clusters: int | str | Sequence[int] | None,
    mode: str | Sequence[str] | None,
    seeds: int | Sequence[int] | None,
) -> tuple[tuple[int, ...], Any, Any]:
    """The swept C, modes and seeds: the arguments, else what ``attention`` sets, else the preset's.

    ``attention`` sets a value when a mapping names it, or when a config object's value differs from the
    preset's (``ClusteredAttentionConfig.for_evaluation()``); ``base`` is that config, validated. The
    cluster counts come back parsed (the one place they are).

    Raises:
        UserError: ``attention`` sets one of them and the argument says otherwise (one would be lost).
    """
    preset = ClusteredAttentionConfig.for_evaluation()
    names = ("clusters", "mode", "seed")
    if isinstance(attention, ClusteredAttentionConfig):
        named = {name for name in names if getattr(attention, name) != getattr(preset, name)}
    else:
        named = {name for name in names if name in (attention or {})}
    given = {
        "clusters": None if clusters is None else parse_clusters(clusters),
        "mode": None if mode is None else ((mode,) if isinstance(mode, str) else tuple(dict.fromkeys(mode))),
        "seed": None if seeds is None else runner.parse_seeds(seeds),
    }
    arguments = {"clusters": "clusters", "mode": "mode", "seed": "seeds"}
    for name in sorted(named):
        if given[name] is not None and given[name] != (getattr(base, name),):
            shown = ",".join(str(value) for value in given[name])
            raise UserError(
                f"attention= sets {name}={getattr(base, name)!r} and {arguments[name]}= says {shown}: "
                f"give {name} in one place"
            )
    if seeds is None:
        seeds = [base.seed]
    return given["clusters"] or (base.clusters,), mode, seeds


def evaluate(
    model: str | Path | None = None,
    tasks: str | Sequence[str] | None = None,
    clusters: int | str | Sequence[int] | None = None,
    *,
    mode: str | Sequence[str] | None = None,
    seeds: int | Sequence[int] | None = None,
    attention: ClusteredAttentionConfig | Mapping[str, Any] | None = None,
    data_dir: str | Path | Sequence[str | Path] | None = None,
    max_length: int | None = None,
    batch_size: int | None = None,
    device: str = "cpu",
    limit: int | None = None,
    output: str | Path | None = None,
    overwrite: bool = False,
    reporter: Any = None,
) -> Results:
    """Score ``model`` unmodified and patched with clustered attention in every configuration.

    Args:
        model: hub id, local folder or ``package:NAME``; ``{task}`` in it is replaced by each task's
            name (one checkpoint per task). None: the embedded default run (its YAML fills every
            argument left as None).
        tasks: task names (see ``bert-cluster ls``), a list or one comma-separated string.
        clusters: cluster counts C, e.g. ``[10, 25]`` or ``"10,25"`` (default: ``attention``'s C, else
            the evaluator's preset's, 25).
        mode: one mode or several (each is run at every C); default: the attention config's.
        seeds: N (seeds 0..N-1) or explicit seeds; each seeds the hash planes. Default: the seed of
            ``attention``, else the preset's (0).
        attention: the other settings (topk, bits, iterations, min_length, layers, backend): a
            ``ClusteredAttentionConfig`` used as it is, or a mapping of the settings to change from the
            evaluator's defaults (``convert``'s, except ``min_length=0``: every row is approximated).
            A C, mode or seed set here and contradicted by ``clusters``, ``mode`` or ``seeds`` is a
            ``UserError`` (never silently replaced).
        data_dir: folder(s) holding the tasks' files (searched one level down too); None: packaged
            files, then the hub.
        max_length: truncation length; None: each task's default.
        batch_size: None: each task's default.
        device: ``cpu`` or ``cuda`` (under ``accelerate launch``, each process takes its own GPU).
        limit: score N examples per task (retrieval: N questions and a corpus cut in proportion).
        output: folder for results.json, results.md and scores.png (None: write nothing); it must be
            empty unless ``overwrite``.
        overwrite: replace the files of an earlier run in ``output``.
        reporter: progress callbacks (``runner.Reporter``); None: silent.

    Raises:
        UserError: a mistake in the arguments, found before any work. Failures inside one task do not
            raise: the task is recorded as failed in the results.
        RunInterrupted: Ctrl-C; ``.results`` holds what was measured (written to ``output`` first).
    """
    defaults: dict[str, Any] = {}
    if model is None:
        defaults = default_run()
        model = defaults["model"]
        tasks = tasks if tasks is not None else defaults.get("tasks")
        clusters = clusters if clusters is not None else defaults.get("clusters")
        mode = mode if mode is not None else defaults.get("mode")
        seeds = seeds if seeds is not None else defaults.get("seeds")
        limit = limit if limit is not None else defaults.get("limit")
        batch_size = batch_size if batch_size is not None else defaults.get("batch_size")
        max_length = max_length if max_length is not None else defaults.get("max_length")
        data_dir = data_dir if data_dir is not None else defaults.get("data_dir")
    if tasks is None or (not isinstance(tasks, str) and len(tasks) == 0):
        raise UserError("name the task(s) to run, e.g. --task rte,mrpc (bert-cluster ls lists them)")
    for name, value in (("limit", limit), ("batch_size", batch_size), ("max_length", max_length)):
        if value is not None:
            positive_int(name, value)
    task_configs = tuple(get_tasks(tasks if isinstance(tasks, str) else list(tasks)))
    base = attention_config(attention, defaults.get("attention", {}), presets.EVALUATION_SETTINGS)
    clusters, mode, seeds = _swept(attention, base, clusters, mode, seeds)
    modes = (mode,) if isinstance(mode, str) else tuple(mode or ())
    device = check_device(device)
    plan = runner.RunPlan(
        model=resolve_model(model),
        tasks=task_configs,
        clusters=clusters,
        seeds=runner.parse_seeds(seeds),
        attention=base,
        modes=tuple(dict.fromkeys(modes)),
        data_dirs=tuple(data_dirs(data_dir)) if data_dir is not None else (),
        limit=limit,
        batch_size=batch_size,
        max_length=max_length,
        device=device,
    )
    try:
        configurations = plan.configurations()  # every mode, C and seed validated now, not mid-run
    except (TypeError, ValueError) as error:
        raise UserError(str(error)) from None
    for backend in {config.backend for config in configurations}:
        runner.attention_backend(base.replace(backend=backend), device)
    for task in task_configs:
        _check_positions(check_model_path(plan.model_for(task)), max_length, task)
    if output is not None:
        check_output(output, overwrite)
    workers = Workers(device)
    main = workers.is_main and output is not None
    partial = (lambda so_far: report.write(so_far, output)) if main else None
    try:
        results = runner.run_plan(plan, reporter, partial, workers)
    except RunInterrupted as interrupted:
        if main:
            interrupted.written = report.write(interrupted.results, output)["results.json"]
        raise
    if main:
        report.write(results, output)
    return results


#: The name the style guide's CLI calls (``evaluation.run``).
run = evaluate
