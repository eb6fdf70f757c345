"""The paper's steps and the attention modes, listed once.

``STEPS``: each step's name, the function of ``bert_cluster.reference`` that defines it, the backends whose
kernels compile its op and how its gradient is computed. The reference function also declares the op:
``ops.py`` takes the ``bert_cluster::<name>`` schema and the typed wrapper from its signature (and keeps
the fake kernel and the autograd formula beside it; the fused ops, whose reference composes the steps in
``attention.py``, above ``ops.py``, are declared there by a signature of their own), ``dispatch.py``'s
backends run the op where this table says their kernels compile it and the reference elsewhere, and the
tests check the table against the registrations in ``torch.ops``. Adding a step: ``kernels/README.md``.

``MODES``: what each attention mode computes, in terms of those steps (``attention.partition`` and
``attention.refined`` compose them; ``ops.clustered_steps_backward`` chains their backward).

Imports nothing (the tables are data): every module may read them.
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
    """One step: the function that defines it, which kernels compile its op, how its gradient is computed."""

    name: str
    #: The kernel backends whose kernels implement the op; the others run ``reference`` for it.
    compiled: tuple[str, ...]
    #: The function that defines the step, ``module.function`` in the package: the op's oracle, whose
    #: signature is the op's (``ops.Op``).
    reference: str
    #: False: no op (torch runs the step).
    op: bool = True
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
    Step("hash_queries", BOTH, "reference.hash_queries"),
    Step("hamming_kmeans", BOTH, "reference.hamming_kmeans"),
    Step("group_queries", BOTH, "reference.group_queries", backward="group_queries_backward"),
    Step("centroid_attention", BOTH, "reference.centroid_attention", backward="centroid_attention_backward"),
    # The refinements and the band take attention dropout (training) as their last two arguments, dropout
    # and seed (0 and 0: none). The CPU kernels drop the weights in place, with the masks of
    # reference.dropout_uniforms drawn from the seed (kernels/cpu/dropout.cpp); the CUDA kernels have no
    # dropout, so dispatch.py refuses dropout > 0 there.
    Step("topk_refine", BOTH, "reference.topk_refine", backward="topk_refine_backward"),
    Step("broadcast_clusters", BOTH, "reference.broadcast_clusters", backward="broadcast_clusters_backward"),
    Step("banded_attention", BOTH, "reference.banded_attention", backward="banded_attention_backward"),
    # Exact attention on short rows is torch's SDPA in attention.py: no op; every backend runs the reference.
    Step("exact_attention", (), "reference.exact_attention", op=False),
    # i-clustered+ (issue 13): Lloyd rounds on the query vectors, refinement with each query's own mass.
    # lloyd_refine's centroids are the means of its final partition: group_queries' backward with those
    # assignments.
    Step("lloyd_refine", BOTH, "reference.lloyd_refine", backward="group_queries_backward"),
    Step(
        "refine_with_query_mass",
        BOTH,
        "reference.refine_with_query_mass",
        backward="refine_with_query_mass_backward",
    ),
    # The refinements' backward (issue 38): the exact gradient given the forward's discrete choices, from
    # the output gradient (kernels/cpu/backward.cpp, kernels/cuda/backward.cu and plus.cu; where no kernel is
    # built the reference's, by autograd).
    Step("topk_refine_backward", BOTH, "reference.topk_refine_backward"),
    Step("refine_with_query_mass_backward", BOTH, "reference.refine_with_query_mass_backward"),
    # The backward of the steps before the refinement (kernels/cpu/backward_steps.cpp, cuda/backward.cu):
    # centroid attention given its top-k choice, the means (group_queries, and lloyd_refine's centroids
    # given its final partition), the broadcast of the centroids' rows, the band.
    Step("centroid_attention_backward", BOTH, "reference.centroid_attention_backward"),
    # The same, adding the key and value gradients into the refinement's (one N-row tensor fewer per head
    # at the backward's peak: ops.clustered_steps_backward).
    Step("centroid_attention_backward_into", BOTH, "reference.centroid_attention_backward_into"),
    Step("group_queries_backward", BOTH, "reference.group_queries_backward"),
    Step("broadcast_clusters_backward", BOTH, "reference.broadcast_clusters_backward"),
    Step("banded_attention_backward", BOTH, "reference.banded_attention_backward"),
    # Attention dropout in training (issue 38, item 2; kernels/cpu/dropout.cpp): the centroids' attention
    # over the keys outside their top-k, dropped per (centroid, key); the refinements then drop each
    # query's top-k weights per (query, key). The masks are hashes of (seed, positions)
    # (reference.dropout_uniforms), drawn again by the backward, never saved.
    Step("centroid_rest", CPU, "reference.centroid_rest", backward="centroid_rest_backward"),
    Step("centroid_rest_backward", CPU, "reference.centroid_rest_backward"),
    # Every step of one call per (row, head) in one parallel region (kernels/cpu/pipeline.cpp), with the
    # composed steps' result bit for bit.
    Step("clustered_heads", CPU, "attention.composed_heads", fused=True),
    # The same call keeping its partition (the steps' results before the last), which a pass that records
    # gradients saves for the backward (issue 38: attention._StepsWithBackward).
    Step("clustered_heads_partition", CPU, "attention.composed_heads_partition", fused=True),
)

BY_NAME: dict[str, Step] = {step.name: step for step in STEPS}


def compiled_by(backend: str) -> tuple[str, ...]:
    """The names of the ops ``backend``'s kernels implement (what its availability requires)."""
    return tuple(step.name for step in STEPS if backend in step.compiled)


@dataclasses.dataclass(frozen=True)
class Mode:
    """What one attention mode computes: how it groups the queries and how each query gets its output."""

    name: str
    #: The Hamming partition is refined by Lloyd rounds on the query vectors (``lloyd_refine``, whose
    #: centroids are the new partition's means) instead of grouped as it is (``group_queries``).
    lloyd: bool
    #: Each cluster's k keys of highest centroid attention are recomputed exactly for its queries (k > 0
    #: in ``centroid_attention``); without, every query takes its centroid's row (``broadcast_clusters``).
    uses_topk: bool
    #: Each query gets its own share of attention on those keys (``refine_with_query_mass``) rather than
    #: its centroid's (``topk_refine``).
    query_mass: bool

    @property
    def refinement(self) -> str:
        """The step that gives each query its output."""
        if not self.uses_topk:
            return "broadcast_clusters"
        return "refine_with_query_mass" if self.query_mass else "topk_refine"


#: Every mode by name, in ``config.MODES``' order (the names a config accepts).
MODES: dict[str, Mode] = {
    # The paper's improved clustered attention.
    "i-clustered": Mode("i-clustered", lloyd=False, uses_topk=True, query_mass=False),
    # The paper's clustered attention: each query takes its centroid's output.
    "clustered": Mode("clustered", lloyd=False, uses_topk=False, query_mass=False),
    # i-clustered on a partition refined in the queries' own space, each query with its own share of
    # attention on the exactly recomputed keys (issue 13; README, "Fidelity").
    "i-clustered+": Mode("i-clustered+", lloyd=True, uses_topk=True, query_mass=True),
}
