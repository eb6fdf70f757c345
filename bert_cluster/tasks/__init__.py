"""Tasks, the base ``evaluate`` and ``finetune`` drive: the task config, its data and the kinds.

A task is data (``configs/tasks/**/*.yaml``, read into a ``TaskConfig`` by ``config``, the one reader of
task YAML); ``data`` reads its rows (local files first, the hub when reachable); a kind (``kinds``) owns
everything a family of tasks needs: how its model is loaded with its head (through
``bert_cluster.checkpoints``), the features it trains on (what ``finetune`` hands the Trainer) and how it
is scored (what ``evaluate`` computes). ``bert_cluster.evaluation`` and ``bert_cluster.finetuning`` are
drivers over these.
"""

from __future__ import annotations

from bert_cluster.tasks.config import (
    TaskCatalog,
    TaskConfig,
    config_root,
    get_tasks,
    label_index,
    label_mapping,
    load_catalog,
    load_task_file,
    load_tasks,
    parse_task,
    read_mapping,
)
from bert_cluster.tasks.data import Rows, data_dirs, load_rows, load_task_texts
from bert_cluster.tasks.kinds import KINDS, Examples, LoadedModel, ScoreSettings, TaskKind, get_kind

__all__ = [
    "KINDS",
    "Examples",
    "LoadedModel",
    "Rows",
    "ScoreSettings",
    "TaskCatalog",
    "TaskConfig",
    "TaskKind",
    "config_root",
    "data_dirs",
    "get_kind",
    "get_tasks",
    "label_index",
    "label_mapping",
    "load_catalog",
    "load_rows",
    "load_task_file",
    "load_task_texts",
    "load_tasks",
    "parse_task",
    "read_mapping",
]
