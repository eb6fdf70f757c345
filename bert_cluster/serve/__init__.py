"""``bert-cluster serve``: sentence embeddings over HTTP, the offline ``embed`` path behind a batcher.

Three parts, as TEI's router and Infinity keep them: the HTTP layer (``app``: FastAPI routes, request
models, one error shape, limits, Prometheus metrics), the ``batcher`` (a queue, a token budget, a
bounded wait) and the model ``runner`` (``embed``'s loading and ``SentenceTransformer.encode`` call).
``create_app`` gives the ASGI app; ``run_server`` runs it on uvicorn. Needs the ``serve`` extra
(``pip install bert-cluster[serve]``); ``import bert_cluster`` never imports this package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bert_cluster.serve.settings import ServeSettings

if TYPE_CHECKING:
    from fastapi import FastAPI

__all__ = ["ServeSettings", "create_app", "run_server"]

#: The packages of the ``serve`` extra (module name: distribution name).
REQUIRED = {"fastapi": "fastapi", "uvicorn": "uvicorn", "prometheus_client": "prometheus-client"}


def require_extra() -> None:
    """Refuse, naming the extra, when the server's packages are not installed.

    Raises:
        UserError: one of ``REQUIRED`` is missing.
    """
    import importlib.util

    from bert_cluster.errors import UserError

    missing = [name for module, name in REQUIRED.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise UserError(
            f"serving needs {', '.join(missing)}: pip install 'bert-cluster[serve]' (the serve extra)"
        )


def create_app(settings: ServeSettings | str, **options: Any) -> FastAPI:
    """The ASGI app serving ``settings`` (or a model path and ``ServeSettings``' fields as keywords).

    The model loads now; the warm-up runs when the app starts, and ``GET /ready`` answers 200 after it.

    Raises:
        UserError: the serve extra is missing, bad or contradictory settings, or an unloadable model.
    """
    require_extra()
    from bert_cluster.serve.app import create_app as _create_app

    return _create_app(settings, **options)


def run_server(settings: ServeSettings, **options: Any) -> None:
    """Serve ``settings`` on uvicorn until SIGTERM or SIGINT; see ``bert_cluster.serve.server.run_server``."""
    require_extra()
    from bert_cluster.serve.server import run_server as _run_server

    _run_server(settings, **options)
