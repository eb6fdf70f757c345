"""`import bert_cluster` builds, loads and registers nothing, touches no network and no CUDA."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap


def run_fresh(code: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_import_is_lean():
    facts = run_fresh("""
        import json, socket, sys
        def no_network(*args, **kwargs):
            raise AssertionError("network touched at import")
        socket.socket.connect = no_network
        socket.create_connection = no_network
        import bert_cluster
        import torch
        print(json.dumps({
            "modules": sorted(m for m in sys.modules if m.startswith(
                ("bert_cluster", "transformers", "datasets", "evaluate", "pandas", "matplotlib",
                 "fastapi", "starlette", "uvicorn", "prometheus_client"))),
            "cuda_initialized": torch.cuda.is_initialized(),
            "ops_namespace_loaded": "bert_cluster" in torch.ops.loaded_libraries or any(
                "bert_cluster" in str(lib) for lib in torch.ops.loaded_libraries),
            "public": sorted(bert_cluster.__all__),
        }))
    """)
    assert facts["modules"] == [
        "bert_cluster",
        "bert_cluster._hook",
        "bert_cluster._version",  # the one place the version is written
        "bert_cluster.attention",
        "bert_cluster.config",
        "bert_cluster.environment",  # the environment variables' readers: stdlib only
    ]
    assert facts["cuda_initialized"] is False
    assert facts["ops_namespace_loaded"] is False
    assert facts["public"] == [
        "ClusteredAttentionConfig",
        "__version__",
        "clustered_attention",
        "convert",
        "embed",
        "evaluate",
        "finetune",
        "info",
        "inspect_model",
        "revert",
    ]


def test_transformers_learns_the_name_once_it_loads_and_evaluate_is_lazy():
    facts = run_fresh("""
        import json, sys
        import bert_cluster
        before = "transformers" in sys.modules
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
        registered = ("bert_cluster" in AttentionInterface._global_mapping,
                      "bert_cluster" in AttentionMaskInterface._global_mapping)
        evaluate = bert_cluster.evaluate
        embed = bert_cluster.embed
        print(json.dumps({"before": before, "registered": registered,
                          "callable": [callable(evaluate), callable(embed)]}))
    """)
    assert facts == {"before": False, "registered": [True, True], "callable": [True, True]}
