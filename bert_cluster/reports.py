"""The one report writer (JSON + markdown + plot, with the run's metadata) and the facts it records.

``write_report`` writes every report bert-cluster makes: evaluate's results.json / results.md /
scores.png (``evaluation.report.write``), tune's tune.* (``evaluation.tuner.write``), inspect's
inspect.* (``inspection.write``) and embed's manifest facts (``environment``). Each JSON document
carries ``settings`` and ``environment`` (package versions, hardware, git hash, date:
``environment()``), each markdown file ends with the same settings-and-environment section
(``metadata_markdown``), and the JSON lists the files written.

Files are written atomically (a temporary file, then a rename) into a folder that was empty or that
the user allowed to be overwritten; the JSON lists the files written, so a later ``--overwrite``
removes the earlier report's files that it does not write again, and nothing else.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import subprocess
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from bert_cluster import environment as machine
from bert_cluster.errors import UserError, one_line

#: The keys of ``environment()`` that every report's markdown shows.
METADATA_KEYS = ("packages", "hardware", "git", "date")
_PACKAGES = (
    "bert-cluster",
    "torch",
    "transformers",
    "tokenizers",
    "datasets",
    "sentence-transformers",
    "accelerate",
    "numpy",
    "scipy",
    "scikit-learn",
)


@dataclasses.dataclass(frozen=True)
class ReportFiles:
    """The names of the files one kind of report writes: its JSON, its markdown, a plot, further files."""

    json: str
    markdown: str
    plot: str | None = None
    extra: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        """Every name, the only ones a later write into the same folder may remove."""
        return (self.json, self.markdown, *((self.plot,) if self.plot else ()), *self.extra)


def _git_hash() -> str | None:
    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():
        return None
    try:
        head, dirty = (
            subprocess.run(
                ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=5, check=False
            )
            for args in (["rev-parse", "HEAD"], ["status", "--porcelain", "--untracked-files=no"])
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def environment(device: str = "cpu", processes: int = 1) -> dict[str, Any]:
    """Package versions, hardware, git hash and date: what makes a results.json interpretable later."""
    import torch

    versions = {"python": platform.python_version()}
    for package in _PACKAGES:
        versions[package] = machine.package_version(package)
    hardware: dict[str, Any] = {
        "platform": platform.platform(),
        "cpu": machine.cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": device,
        "processes": processes,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        hardware["gpu"] = torch.cuda.get_device_name(torch.device(device))
    try:
        from bert_cluster._build import build_info  # imports the kernels: only when a report is made

        kernels: Any = build_info()
    except Exception as error:  # noqa: BLE001 - informational only; never fail a run over it
        kernels = f"unavailable: {type(error).__name__}: {one_line(error)}"
    return {
        "packages": versions,
        "hardware": hardware,
        "kernels": kernels,
        "git": _git_hash(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def markdown_table(header: list[str], rows: list[list[str]], right_from: int) -> list[str]:
    """A markdown table's lines: the first ``right_from`` columns left-aligned, the others right."""
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] * right_from + ["---:"] * (len(header) - right_from)) + "|",
    ]
    return lines + ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]


def metadata_markdown(settings: Mapping[str, Any], environment: Mapping[str, Any]) -> list[str]:
    """The closing section of every report's markdown: its settings, package versions, hardware, git, date."""
    document = {"settings": settings, **{key: environment.get(key) for key in METADATA_KEYS}}
    return ["## Settings and environment", "", "```json", json.dumps(document, indent=2), "```", ""]


def atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """``write(temporary path)``, then rename it to ``path``: a reader never sees half a file."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(handle)
    umask = os.umask(0)
    os.umask(umask)
    try:
        write(temporary)
        os.chmod(temporary, 0o666 & ~umask)  # mkstemp makes it private; the result is an ordinary file
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def check_output(folder: str | Path, overwrite: bool = False) -> Path:
    """Refuse an output folder that cannot be written, or that holds files, before any work is done.

    Raises:
        UserError: ``folder`` is a file, lies under a file, is not writable, or is not empty (without
            ``overwrite``).
    """
    folder = Path(folder).expanduser()
    if folder.exists():
        if not folder.is_dir():
            raise UserError(f"output {folder} is a file, not a folder")
        present = sorted(entry.name for entry in folder.iterdir())
        if present and not overwrite:
            shown = ", ".join(present[:5]) + (", ..." if len(present) > 5 else "")
            raise UserError(
                f"output folder {folder} is not empty ({shown}); choose another folder or pass --overwrite "
                "(which replaces only the files a run writes)"
            )
        if not os.access(folder, os.W_OK | os.X_OK):
            raise UserError(f"output folder {folder} is not writable")
        return folder
    parent = folder.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"output {folder} cannot be created: {parent} is a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"output {folder} cannot be created: {parent} is not writable")
    return folder


def write_report(
    folder: str | Path,
    files: ReportFiles,
    document: Mapping[str, Any],
    text: str,
    *,
    plot: Callable[[Path], Path | None] | None = None,
    extra: Mapping[str, str] | None = None,
) -> dict[str, Path]:
    """Write one report into ``folder``: the plot, further text files, the markdown, then the JSON.

    ``document`` must carry ``settings`` and ``environment`` (``environment()``): a report without the
    versions, git hash and date it came from cannot be interpreted later. ``plot(path)`` draws the plot
    (None: nothing to draw). The JSON is written last, with the names written under ``files``; files
    of an earlier report of the same kind listed in its JSON and not written now are removed (a stale
    plot never sits beside new numbers); no other file is touched. Every file is written atomically.

    Raises:
        ValueError: ``document`` lacks its metadata, or ``extra`` names a file ``files`` does not list.
        UserError: ``folder`` cannot be created.
    """
    missing = [key for key in ("settings", "environment") if key not in document]
    missing += [f"environment.{key}" for key in METADATA_KEYS if key not in document.get("environment", {})]
    if missing:
        raise ValueError(f"a report document needs its metadata; missing {', '.join(dict.fromkeys(missing))}")
    unknown = sorted(set(extra or {}) - set(files.extra))
    if unknown:
        raise ValueError(f"extra file(s) {unknown} are not among this report's files {list(files.names)}")
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        reason = error.strerror or one_line(error)
        raise UserError(f"cannot create output folder {folder}: {reason}") from None
    written: dict[str, Path] = {}

    def put(name: str, content: str) -> None:
        written[name] = folder / name
        atomic_write(written[name], lambda temporary: Path(temporary).write_text(content, encoding="utf-8"))

    if plot is not None and files.plot is not None and plot(folder / files.plot) is not None:
        written[files.plot] = folder / files.plot
    for name, content in (extra or {}).items():
        put(name, content)
    put(files.markdown, text)
    earlier = _listed(folder / files.json, files.names)
    put(files.json, json.dumps({**document, "files": sorted({*written, files.json})}, indent=2) + "\n")
    for name in earlier - set(written):
        (folder / name).unlink(missing_ok=True)
    return written


def _listed(path: Path, names: tuple[str, ...]) -> set[str]:
    """The files an earlier report's JSON says it wrote (only ``names``, the ones this kind writes)."""
    try:
        listed = json.loads(path.read_text(encoding="utf-8")).get("files", [])
    except (OSError, ValueError, AttributeError):
        return set()
    return {name for name in listed if name in names}
