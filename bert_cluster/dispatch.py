"""The one place that chooses a backend (cuda | cpu | reference) and says why.

Each backend declares the devices and dtypes it supports, whether it has attention dropout, whether it is
available, and the reasons it cannot run given inputs. ``auto`` takes the first backend in priority order
with no reasons; a forced backend that cannot run raises a ``ValueError`` listing them.
``BERT_CLUSTER_BACKEND`` overrides ``auto`` and ``BERT_CLUSTER_DISABLE_KERNELS=1`` forces the reference.

A backend's steps are its methods, one per row of ``steps.STEPS``: the reference's function by default,
the op (``bert_cluster.ops``) where the backend's kernels compile the step (``Step.compiled``).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from bert_cluster import environment, ops, reference, steps

#: The steps every backend has (``steps.STEPS`` but the fused op, which only its compilers have).
STEPS = tuple(step.name for step in steps.STEPS if not step.fused)


class Backend:
    """A set of implementations of the paper's steps, with the ops' signatures.

    The steps default to the reference's functions, on whatever device the tensors are; a kernel backend
    replaces those its kernels compile with the ops. The fused ops are None where a backend has none
    (``attention`` then composes the steps).
    """

    name: ClassVar[str]
    SUPPORTED_DEVICES: ClassVar[frozenset[str]]
    SUPPORTED_DTYPES: ClassVar[frozenset[torch.dtype]] = frozenset(
        {torch.float32, torch.float16, torch.bfloat16}
    )
    #: Whether the backend computes attention dropout (training); one without refuses dropout > 0.
    HAS_DROPOUT: ClassVar[bool] = True

    hash_queries = staticmethod(reference.hash_queries)
    hamming_kmeans = staticmethod(reference.hamming_kmeans)
    group_queries = staticmethod(reference.group_queries)
    centroid_attention = staticmethod(reference.centroid_attention)
    topk_refine = staticmethod(reference.topk_refine)
    broadcast_clusters = staticmethod(reference.broadcast_clusters)
    banded_attention = staticmethod(reference.banded_attention)
    exact_attention = staticmethod(reference.exact_attention)
    lloyd_refine = staticmethod(reference.lloyd_refine)
    refine_with_query_mass = staticmethod(reference.refine_with_query_mass)
    topk_refine_backward = staticmethod(reference.topk_refine_backward)
    refine_with_query_mass_backward = staticmethod(reference.refine_with_query_mass_backward)
    centroid_attention_backward = staticmethod(reference.centroid_attention_backward)
    centroid_attention_backward_into = staticmethod(reference.centroid_attention_backward_into)
    group_queries_backward = staticmethod(reference.group_queries_backward)
    broadcast_clusters_backward = staticmethod(reference.broadcast_clusters_backward)
    banded_attention_backward = staticmethod(reference.banded_attention_backward)
    centroid_rest = staticmethod(reference.centroid_rest)
    centroid_rest_backward = staticmethod(reference.centroid_rest_backward)
    clustered_heads: ClassVar[ops.Op | None] = None
    clustered_heads_partition: ClassVar[ops.Op | None] = None

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """Whether the backend can run at all here, and why not."""
        return True, ""

    @classmethod
    def not_supported_reasons(cls, *inputs: torch.Tensor, dropout: float = 0.0) -> list[str]:
        """Why this backend cannot run on these inputs, with this attention dropout (empty when it can)."""
        reasons = []
        ok, why = cls.is_available()
        if not ok:
            reasons.append(why)
        for tensor in inputs:
            if tensor.device.type not in cls.SUPPORTED_DEVICES:
                reasons.append(f"device {tensor.device.type} not in {sorted(cls.SUPPORTED_DEVICES)}")
                break
        for tensor in inputs:
            if tensor.dtype not in cls.SUPPORTED_DTYPES:
                reasons.append(f"dtype {tensor.dtype} not supported")
                break
        if dropout > 0 and not cls.HAS_DROPOUT:
            reasons.append(f"attention dropout (training, p={dropout}): the {cls.name} kernels have none")
        return reasons


class ReferenceBackend(Backend):
    """Plain PyTorch (``bert_cluster.reference``): any device torch runs on, differentiable."""

    name = "reference"
    SUPPORTED_DEVICES = frozenset({"cpu", "cuda", "mps", "xpu"})


class _KernelBackend(Backend):
    """The ops (``bert_cluster.ops``) every kernel backend compiles; their backward is registered there."""

    #: The dispatch key whose kernels ``_C`` must register (``CPU`` or ``CUDA``).
    DISPATCH_KEY: ClassVar[str]

    hash_queries = staticmethod(ops.hash_queries)
    hamming_kmeans = staticmethod(ops.hamming_kmeans)
    group_queries = staticmethod(ops.group_queries)
    centroid_attention = staticmethod(ops.centroid_attention)
    topk_refine = staticmethod(ops.topk_refine)
    broadcast_clusters = staticmethod(ops.broadcast_clusters)
    banded_attention = staticmethod(ops.banded_attention)
    lloyd_refine = staticmethod(ops.lloyd_refine)
    refine_with_query_mass = staticmethod(ops.refine_with_query_mass)
    topk_refine_backward = staticmethod(ops.topk_refine_backward)
    refine_with_query_mass_backward = staticmethod(ops.refine_with_query_mass_backward)
    centroid_attention_backward = staticmethod(ops.centroid_attention_backward)
    centroid_attention_backward_into = staticmethod(ops.centroid_attention_backward_into)
    group_queries_backward = staticmethod(ops.group_queries_backward)
    broadcast_clusters_backward = staticmethod(ops.broadcast_clusters_backward)
    banded_attention_backward = staticmethod(ops.banded_attention_backward)

    @classmethod
    def _kernels_available(cls) -> tuple[bool, str]:
        state = ops.load_kernels()
        if not state["loaded"]:
            return False, state["reason"]
        missing = ops.missing_kernels(cls.DISPATCH_KEY)
        if missing:
            return False, f"bert_cluster._C registered no {cls.DISPATCH_KEY} kernel for {', '.join(missing)}"
        return True, ""


class CpuKernelBackend(_KernelBackend):
    """C++ kernels (``kernels/cpu``), parallel over rows, heads and clusters with ``at::parallel_for``."""

    name = "cpu"
    SUPPORTED_DEVICES = frozenset({"cpu"})
    DISPATCH_KEY = "CPU"

    centroid_rest = staticmethod(ops.centroid_rest)
    centroid_rest_backward = staticmethod(ops.centroid_rest_backward)
    clustered_heads = ops.clustered_heads
    clustered_heads_partition = ops.clustered_heads_partition

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """Available when ``bert_cluster._C`` loaded and registered every CPU kernel."""
        return cls._kernels_available()


class CudaKernelBackend(_KernelBackend):
    """CUDA kernels (``kernels/cuda``), on the tensors' current stream; no attention dropout."""

    name = "cuda"
    SUPPORTED_DEVICES = frozenset({"cuda"})
    DISPATCH_KEY = "CUDA"
    HAS_DROPOUT = False

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """Available when the CUDA ops are registered (by ``_C`` or the first-use build), on a GPU."""
        from bert_cluster import _cuda_jit

        state = ops.load_kernels()
        if not _cuda_jit.loaded():
            if not state["loaded"]:
                return False, f"{state['reason']}; {_cuda_jit.note()}"
            if not state["with_cuda"]:
                return False, f"bert_cluster._C was built without CUDA; {_cuda_jit.note()}"
        missing = ops.missing_kernels(cls.DISPATCH_KEY)
        if missing:
            return False, f"no {cls.DISPATCH_KEY} kernel is registered for {', '.join(missing)}"
        if not torch.cuda.is_available():
            return False, "no CUDA device visible to torch"
        return True, ""

    _first_use_done: ClassVar[bool] = False

    @classmethod
    def _build_on_first_use(cls) -> None:
        if cls._first_use_done:
            return
        cls._first_use_done = True
        from bert_cluster import _cuda_jit

        state = ops.load_kernels()
        if state["loaded"] and state["with_cuda"]:
            return  # _C carries the CUDA kernels
        if environment.kernels_disabled() or not torch.cuda.is_available() or _cuda_jit.why_not():
            return
        _cuda_jit.build()

    #: The largest head dim (Dk or Dv) the CUDA kernels take: refinement and the band keep a query's output
    #: in registers (16 values per lane) and its query in shared memory.
    MAX_HEAD_DIM: ClassVar[int] = 512

    @classmethod
    def not_supported_reasons(cls, *inputs: torch.Tensor, dropout: float = 0.0) -> list[str]:
        """As the other kernels, plus the head dims the CUDA kernels take (``auto`` then falls back).

        The first CUDA inputs build the CUDA kernels where none are registered (``bert_cluster._cuda_jit``).
        """
        if any(tensor.device.type == "cuda" for tensor in inputs):
            cls._build_on_first_use()
        reasons = super().not_supported_reasons(*inputs, dropout=dropout)
        dims = [int(t.shape[-1]) for t in inputs if t.dim() == 4]
        if any(d > cls.MAX_HEAD_DIM for d in dims):
            reasons.append(f"head dims {sorted(set(dims))} above {cls.MAX_HEAD_DIM}, the CUDA kernels' limit")
        return reasons


#: Priority order for ``auto``: the first backend with no reasons wins.
BACKENDS: dict[str, type[Backend]] = {
    "cuda": CudaKernelBackend,
    "cpu": CpuKernelBackend,
    "reference": ReferenceBackend,
}
PRIORITY: list[str] = ["cuda", "cpu", "reference"]


def _forced_name(requested: str) -> str:
    if environment.kernels_disabled():
        return "reference"
    env = environment.backend_override()
    if requested == "auto" and env:
        if env not in ("auto", *BACKENDS):
            raise ValueError(
                f"{environment.BACKEND}={env!r} is not a backend; allowed: auto, {', '.join(BACKENDS)}"
            )
        return env
    return requested


def select_backend(requested: str, *inputs: torch.Tensor, dropout: float = 0.0) -> Backend:
    """The backend to run ``inputs`` on: ``requested`` if it can, else a ``ValueError`` with its reasons.

    ``dropout``: the call's attention dropout (training), which not every backend has.
    """
    name = _forced_name(requested)
    if name != "auto":
        if name not in BACKENDS:
            raise ValueError(f"unknown backend {name!r}; allowed: auto, {', '.join(BACKENDS)}")
        reasons = BACKENDS[name].not_supported_reasons(*inputs, dropout=dropout)
        if reasons:
            raise ValueError(f"backend {name!r} cannot run these inputs: " + "; ".join(reasons))
        return BACKENDS[name]()
    for candidate in PRIORITY:
        if not BACKENDS[candidate].not_supported_reasons(*inputs, dropout=dropout):
            return BACKENDS[candidate]()
    reasons = [
        f"{n}: {'; '.join(BACKENDS[n].not_supported_reasons(*inputs, dropout=dropout))}" for n in PRIORITY
    ]
    raise ValueError("no backend can run these inputs: " + " | ".join(reasons))


def describe() -> list[dict[str, object]]:
    """Each backend's availability and reason, for ``bert_cluster.info()``."""
    out = []
    for name in PRIORITY:
        ok, why = BACKENDS[name].is_available()
        out.append(
            {
                "backend": name,
                "available": ok,
                "reason": why,
                "devices": sorted(BACKENDS[name].SUPPORTED_DEVICES),
            }
        )
    return out
