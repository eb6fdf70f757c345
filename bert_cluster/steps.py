"""The paper's steps, listed once: name, op schema, reference function, the backends that compile each.

``ops.py`` defines the ``bert_cluster::<name>`` schemas from this table (and keeps each op's fake kernel
and typed wrapper), ``dispatch.py`` gives every backend its steps from it (the compiled op where the
backend's kernels implement it, the reference's function elsewhere) and the tests check it against the
registrations in ``torch.ops``. Adding a step: a row here, the reference function, the fake kernel and
wrapper in ``ops.py``, the kernels of the backends its row names (``kernels/README.md``).

Imports nothing (the table is data): every module may read it.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

#: The backends with compiled kernels, in the order a row names them.
KERNEL_BACKENDS = ("cpu", "cuda")


@dataclasses.dataclass(frozen=True)
class Step:
    """One step: what its op takes, what computes it without kernels, and which kernels compile it."""

    name: str
    #: The op schema after the name (floats are C++ doubles, ints int64); None: no op (torch runs it).
    schema: str | None
    #: The kernel backends whose kernels implement the op; the others run ``reference`` for it.
    compiled: tuple[str, ...]
    #: The function that defines the step, ``module.function`` in the package (the op's oracle).
    reference: str
    #: Every step of a call in one op: only the backends that compile it have it (the others compose
    #: the steps one by one, ``attention.composed_heads``).
    fused: bool = False
    #: How the op's registered backward computes (issue 38): the name of its backward op (a step of this
    #: table, with the kernels it names), or ``AUTOGRAD``: autograd through the reference function given
    #: the forward's discrete choices (assignments, top-k indices), which carry no gradient. None: the op
    #: has no gradient (integer outputs), or no backward (the fused op: a pass that records gradients
    #: composes the steps).
    backward: str | None = None

    def reference_function(self) -> Callable[..., Any]:
        """The reference function itself (imports its module)."""
        module, _, function = self.reference.rpartition(".")
        return getattr(importlib.import_module(f"bert_cluster.{module}"), function)


BOTH = KERNEL_BACKENDS
CPU = ("cpu",)
#: ``Step.backward``: the gradient of the reference function, by autograd, in ``ops.py``.
AUTOGRAD = "autograd"

STEPS: tuple[Step, ...] = (
    Step(
        "hash_queries",
        "(Tensor queries, Tensor planes, Tensor offsets) -> Tensor",
        BOTH,
        "reference.hash_queries",
    ),
    Step(
        "hamming_kmeans",
        "(Tensor hashes, Tensor valid, int clusters, int iterations, int bits) -> (Tensor, Tensor)",
        BOTH,
        "reference.hamming_kmeans",
    ),
    Step(
        "group_queries",
        "(Tensor queries, Tensor assignments, int clusters) -> (Tensor, Tensor)",
        BOTH,
        "reference.group_queries",
        backward="group_queries_backward",
    ),
    Step(
        "centroid_attention",
        "(Tensor centroids, Tensor keys, Tensor values, Tensor valid, int topk, float scaling) "
        "-> (Tensor, Tensor, Tensor, Tensor)",
        BOTH,
        "reference.centroid_attention",
        backward="centroid_attention_backward",
    ),
    Step(
        "topk_refine",
        "(Tensor queries, Tensor keys, Tensor values, Tensor assignments, Tensor centroid_values, "
        "Tensor topk_indices, Tensor topk_mass, Tensor topk_values, float scaling) -> Tensor",
        BOTH,
        "reference.topk_refine",
        backward="topk_refine_backward",
    ),
    Step(
        "broadcast_clusters",
        "(Tensor centroid_values, Tensor assignments) -> Tensor",
        BOTH,
        "reference.broadcast_clusters",
        backward="broadcast_clusters_backward",
    ),
    Step(
        "banded_attention",
        "(Tensor queries, Tensor keys, Tensor values, Tensor valid, int window, float scaling) -> Tensor",
        BOTH,
        "reference.banded_attention",
        backward="banded_attention_backward",
    ),
    # Exact attention on short rows is torch's SDPA in attention.py: no op; every backend runs the reference.
    Step("exact_attention", None, (), "reference.exact_attention"),
    # i-clustered+ (issue 13): Lloyd rounds on the query vectors, refinement with each query's own mass.
    Step(
        "lloyd_refine",
        "(Tensor queries, Tensor assignments, int clusters, int iterations) -> (Tensor, Tensor, Tensor)",
        BOTH,
        "reference.lloyd_refine",
        # Its centroids are the means of its final partition: group_queries' backward with those assignments.
        backward="group_queries_backward",
    ),
    Step(
        "refine_with_query_mass",
        "(Tensor queries, Tensor keys, Tensor values, Tensor valid, Tensor assignments, Tensor centroids, "
        "Tensor centroid_values, Tensor topk_indices, Tensor topk_mass, Tensor topk_values, float scaling) "
        "-> Tensor",
        BOTH,
        "reference.refine_with_query_mass",
        backward="refine_with_query_mass_backward",
    ),
    # The refinements' backward (issue 38): the exact gradient given the forward's discrete choices, from
    # the output gradient (kernels/cpu/backward.cpp, kernels/cuda/backward.cu and plus.cu; where no kernel is
    # built the reference's, by autograd).
    Step(
        "topk_refine_backward",
        "(Tensor grad_out, Tensor queries, Tensor keys, Tensor values, Tensor assignments, "
        "Tensor topk_indices, Tensor topk_mass, float scaling) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
        BOTH,
        "reference.topk_refine_backward",
    ),
    Step(
        "refine_with_query_mass_backward",
        "(Tensor grad_out, Tensor queries, Tensor keys, Tensor values, Tensor valid, Tensor assignments, "
        "Tensor centroids, Tensor centroid_values, Tensor topk_indices, Tensor topk_mass, "
        "Tensor topk_values, float scaling) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
        BOTH,
        "reference.refine_with_query_mass_backward",
    ),
    # The backward of the steps before the refinement (kernels/cpu/backward_steps.cpp, cuda/backward.cu):
    # centroid attention given its top-k choice, the means (group_queries, and lloyd_refine's centroids
    # given its final partition), the broadcast of the centroids' rows, the band.
    Step(
        "centroid_attention_backward",
        "(Tensor grad_centroid_values, Tensor grad_topk_mass, Tensor grad_topk_values, Tensor centroids, "
        "Tensor keys, Tensor values, Tensor valid, Tensor topk_indices, float scaling) "
        "-> (Tensor, Tensor, Tensor)",
        BOTH,
        "reference.centroid_attention_backward",
    ),
    # The same, adding the key and value gradients into the refinement's (one N-row tensor fewer per head
    # at the backward's peak: ops.clustered_steps_backward).
    Step(
        "centroid_attention_backward_into",
        "(Tensor(a!) grad_keys, Tensor(b!) grad_values, Tensor grad_centroid_values, Tensor grad_topk_mass, "
        "Tensor grad_topk_values, Tensor centroids, Tensor keys, Tensor values, Tensor valid, "
        "Tensor topk_indices, float scaling) -> Tensor",
        BOTH,
        "reference.centroid_attention_backward_into",
    ),
    Step(
        "group_queries_backward",
        "(Tensor grad_centroids, Tensor queries, Tensor assignments) -> Tensor",
        BOTH,
        "reference.group_queries_backward",
    ),
    Step(
        "broadcast_clusters_backward",
        "(Tensor grad_out, Tensor centroid_values, Tensor assignments) -> Tensor",
        BOTH,
        "reference.broadcast_clusters_backward",
    ),
    Step(
        "banded_attention_backward",
        "(Tensor grad_out, Tensor queries, Tensor keys, Tensor values, Tensor valid, int window, "
        "float scaling) -> (Tensor, Tensor, Tensor)",
        BOTH,
        "reference.banded_attention_backward",
    ),
    # Attention dropout in training (issue 38, item 2; kernels/cpu/dropout.cpp): the centroids' attention
    # over the keys outside their top-k, dropped per (centroid, key), and the refinements and the band
    # with each query's weights dropped per (query, key). The masks are hashes of (seed, positions)
    # (reference.dropout_uniforms), drawn again by the backward, never saved.
    Step(
        "centroid_rest",
        "(Tensor centroids, Tensor keys, Tensor values, Tensor valid, Tensor topk_indices, float scaling, "
        "float dropout, int seed) -> Tensor",
        CPU,
        "reference.centroid_rest",
        backward="centroid_rest_backward",
    ),
    Step(
        "topk_refine_dropout",
        "(Tensor queries, Tensor keys, Tensor values, Tensor assignments, Tensor centroid_values, "
        "Tensor topk_indices, Tensor topk_mass, Tensor topk_values, float scaling, float dropout, int seed) "
        "-> Tensor",
        CPU,
        "reference.topk_refine_dropout",
        backward="topk_refine_dropout_backward",
    ),
    Step(
        "refine_with_query_mass_dropout",
        "(Tensor queries, Tensor keys, Tensor values, Tensor valid, Tensor assignments, Tensor centroids, "
        "Tensor centroid_values, Tensor topk_indices, Tensor topk_mass, Tensor topk_values, float scaling, "
        "float dropout, int seed) -> Tensor",
        CPU,
        "reference.refine_with_query_mass_dropout",
        backward="refine_with_query_mass_dropout_backward",
    ),
    Step(
        "banded_attention_dropout",
        "(Tensor queries, Tensor keys, Tensor values, Tensor valid, int window, float scaling, "
        "float dropout, int seed) -> Tensor",
        CPU,
        "reference.banded_attention_dropout",
        backward="banded_attention_dropout_backward",
    ),
    Step(
        "centroid_rest_backward",
        "(Tensor grad_rest, Tensor centroids, Tensor keys, Tensor values, Tensor valid, Tensor topk_indices, "
        "float scaling, float dropout, int seed) -> (Tensor, Tensor, Tensor)",
        CPU,
        "reference.centroid_rest_backward",
    ),
    Step(
        "topk_refine_dropout_backward",
        "(Tensor grad_out, Tensor queries, Tensor keys, Tensor values, Tensor assignments, "
        "Tensor topk_indices, Tensor topk_mass, float scaling, float dropout, int seed) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
        CPU,
        "reference.topk_refine_dropout_backward",
    ),
    Step(
        "refine_with_query_mass_dropout_backward",
        "(Tensor grad_out, Tensor queries, Tensor keys, Tensor values, Tensor valid, Tensor assignments, "
        "Tensor centroids, Tensor centroid_values, Tensor topk_indices, Tensor topk_mass, "
        "Tensor topk_values, float scaling, float dropout, int seed) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
        CPU,
        "reference.refine_with_query_mass_dropout_backward",
    ),
    Step(
        "banded_attention_dropout_backward",
        "(Tensor grad_out, Tensor queries, Tensor keys, Tensor values, Tensor valid, int window, "
        "float scaling, float dropout, int seed) -> (Tensor, Tensor, Tensor)",
        CPU,
        "reference.banded_attention_dropout_backward",
    ),
    # Every step of one call per (row, head) in one parallel region (kernels/cpu/pipeline.cpp), with the
    # composed steps' result bit for bit.
    Step(
        "clustered_heads",
        "(Tensor queries, Tensor keys, Tensor values, Tensor valid, Tensor planes, Tensor offsets, "
        "int clusters, int topk, int iterations, str mode, int lloyd_rounds, float scaling) -> Tensor",
        CPU,
        "attention.composed_heads",
        fused=True,
    ),
    # The same call keeping its partition (the steps' results before the last), which a pass that records
    # gradients saves for the backward (issue 38: attention._StepsWithBackward).
    Step(
        "clustered_heads_partition",
        "(Tensor queries, Tensor keys, Tensor values, Tensor valid, Tensor planes, Tensor offsets, "
        "int clusters, int topk, int iterations, str mode, int lloyd_rounds, float scaling) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
        CPU,
        "attention.composed_heads_partition",
        fused=True,
    ),
)

BY_NAME: dict[str, Step] = {step.name: step for step in STEPS}


def compiled_by(backend: str) -> tuple[str, ...]:
    """The names of the ops ``backend``'s kernels implement (what its availability requires)."""
    return tuple(step.name for step in STEPS if backend in step.compiled)
