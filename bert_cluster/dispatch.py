"""The one place that chooses a backend (cuda | cpu | reference) and says why.

Each backend declares the devices and dtypes it supports, whether it is available, and the reasons it
cannot run given inputs. ``auto`` takes the first backend in priority order with no reasons; a forced
backend that cannot run raises a ``ValueError`` listing them. ``BERT_CLUSTER_BACKEND`` overrides
``auto`` and ``BERT_CLUSTER_DISABLE_KERNELS=1`` forces the reference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch

from bert_cluster import environment, reference, steps

#: The steps every backend has (``steps.STEPS`` but the fused op, which only its compilers have).
STEPS = tuple(step.name for step in steps.STEPS if not step.fused)


class Backend:
    """A set of implementations of the paper's steps, with the ops' signatures."""

    name: ClassVar[str]
    SUPPORTED_DEVICES: ClassVar[frozenset[str]]
    SUPPORTED_DTYPES: ClassVar[frozenset[torch.dtype]] = frozenset(
        {torch.float32, torch.float16, torch.bfloat16}
    )

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """Whether the backend can run at all here, and why not."""
        return True, ""

    @classmethod
    def not_supported_reasons(cls, *inputs: torch.Tensor) -> list[str]:
        """Why this backend cannot run on these inputs (empty when it can)."""
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
        return reasons

    def __getattr__(self, step: str) -> Callable:
        raise AttributeError(f"backend {self.name!r} has no step {step!r}; steps: {', '.join(STEPS)}")


class ReferenceBackend(Backend):
    """Plain PyTorch (``bert_cluster.reference``): any device torch runs on, differentiable."""

    name = "reference"
    SUPPORTED_DEVICES = frozenset({"cpu", "cuda", "mps", "xpu"})


def _kernel_step(step: str) -> Callable:
    """A step calling the op ``bert_cluster::<step>`` (lazy import: ``import bert_cluster`` stays lean)."""

    def call(*args):
        from bert_cluster import ops

        return getattr(ops, step)(*args)

    call.__name__ = call.__qualname__ = step
    return staticmethod(call)


class _KernelBackend(Backend):
    """The compiled ops (``bert_cluster.ops``); their backward is registered in ``ops`` (issue 38)."""

    #: The dispatch key whose kernels ``_C`` must register (``CPU`` or ``CUDA``).
    DISPATCH_KEY: ClassVar[str]

    @classmethod
    def _kernels_available(cls) -> tuple[bool, str]:
        from bert_cluster import ops  # lazy: keeps `import bert_cluster` free of kernel loading

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

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """Available when ``bert_cluster._C`` loaded and registered every CPU kernel."""
        return cls._kernels_available()


class CudaKernelBackend(_KernelBackend):
    """CUDA kernels (``kernels/cuda``), on the tensors' current stream."""

    name = "cuda"
    SUPPORTED_DEVICES = frozenset({"cuda"})
    DISPATCH_KEY = "CUDA"

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """Available when the CUDA ops are registered (by ``_C`` or the first-use build), on a GPU."""
        from bert_cluster import _cuda_jit, ops

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
        from bert_cluster import _cuda_jit, ops

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
    def not_supported_reasons(cls, *inputs: torch.Tensor) -> list[str]:
        """As the other kernels, plus the head dims the CUDA kernels take (``auto`` then falls back).

        The first CUDA inputs build the CUDA kernels where none are registered (``bert_cluster._cuda_jit``).
        """
        if any(tensor.device.type == "cuda" for tensor in inputs):
            cls._build_on_first_use()
        reasons = super().not_supported_reasons(*inputs)
        dims = [int(t.shape[-1]) for t in inputs if t.dim() == 4]
        if any(d > cls.MAX_HEAD_DIM for d in dims):
            reasons.append(f"head dims {sorted(set(dims))} above {cls.MAX_HEAD_DIM}, the CUDA kernels' limit")
        return reasons


def _install_steps(backend: type[Backend]) -> None:
    """Give ``backend`` its steps from the table (``steps.STEPS``), the one list of them.

    The compiled op where its kernels implement the step, else the reference function (on the same
    device); a fused step only where it is compiled (None elsewhere: ``attention`` composes the steps).
    """
    for step in steps.STEPS:
        if backend.name in step.compiled:
            implementation: Callable | None = _kernel_step(step.name)
        elif step.fused:
            implementation = None
        else:  # the steps every backend has are functions of bert_cluster.reference
            module, _, function = step.reference.partition(".")
            if module != "reference":
                raise ValueError(
                    f"steps.py: {step.name} is on every backend, so its reference is in reference.py"
                )
            implementation = staticmethod(getattr(reference, function))
        setattr(backend, step.name, implementation)


for _backend in (ReferenceBackend, CpuKernelBackend, CudaKernelBackend):
    _install_steps(_backend)


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


def select_backend(requested: str, *inputs: torch.Tensor) -> Backend:
    """The backend to run ``inputs`` on: ``requested`` if it can, else a ``ValueError`` with its reasons."""
    name = _forced_name(requested)
    if name != "auto":
        if name not in BACKENDS:
            raise ValueError(f"unknown backend {name!r}; allowed: auto, {', '.join(BACKENDS)}")
        reasons = BACKENDS[name].not_supported_reasons(*inputs)
        if reasons:
            raise ValueError(f"backend {name!r} cannot run these inputs: " + "; ".join(reasons))
        return BACKENDS[name]()
    for candidate in PRIORITY:
        if not BACKENDS[candidate].not_supported_reasons(*inputs):
            return BACKENDS[candidate]()
    raise ValueError(
        "no backend can run these inputs: "
        + " | ".join(f"{n}: {'; '.join(BACKENDS[n].not_supported_reasons(*inputs))}" for n in PRIORITY)
    )


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
