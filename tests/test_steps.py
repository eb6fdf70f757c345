"""The table of the paper's steps (``bert_cluster.steps``) against what is registered and dispatched.

Every step has a reference function with the op's argument names, every op a fake kernel, and each
backend that the table says compiles a step has its kernel registered in ``torch.ops`` (and no other
backend has one): the table cannot drift from the kernels, ``ops.py`` or ``dispatch.py``.
"""

from __future__ import annotations

import inspect
import re

import pytest
import torch
from torch._library import simple_registry

from bert_cluster import _loader, dispatch, ops, steps

#: The Python ops that wrap a whole clustered_attention call and its backward for torch.compile
#: (attention.py): not steps.
WHOLE_CALL_OPS = {"clustered_attention", "clustered_attention_backward"}


def schema_arguments(schema: str) -> list[str]:
    """The argument names of a schema such as ``(Tensor queries, int clusters) -> Tensor``."""
    schema = re.sub(r"Tensor\([a-z]!?\)", "Tensor", schema)  # alias annotations: Tensor(a!) out
    inside = schema[schema.index("(") + 1 : schema.index(")")]
    return [re.split(r"\s+", part.strip())[-1] for part in inside.split(",")]


@pytest.mark.parametrize("step", steps.STEPS, ids=lambda step: step.name)
def test_every_step_has_a_reference_with_the_ops_arguments(step):
    function = step.reference_function()
    assert callable(function), step.reference
    if step.schema is not None:
        # The op's arguments, in order; a reference may take keyword-only extras with defaults (attention
        # dropout in training), which the op never passes.
        parameters = inspect.signature(function).parameters.values()
        positional = [p.name for p in parameters if p.kind != inspect.Parameter.KEYWORD_ONLY]
        assert positional == schema_arguments(step.schema)
        extras = [p for p in parameters if p.kind == inspect.Parameter.KEYWORD_ONLY]
        assert all(p.default is not inspect.Parameter.empty for p in extras), step.name
    assert set(step.compiled) <= set(steps.KERNEL_BACKENDS)
    if step.backward not in (None, steps.AUTOGRAD):  # a backward op: a step of the table, from the
        backward = steps.BY_NAME[step.backward]  # gradients of the op's outputs
        assert backward.schema.startswith("(Tensor grad_"), step.backward


@pytest.mark.parametrize("step", [s for s in steps.STEPS if s.schema], ids=lambda step: step.name)
def test_a_step_with_a_backward_in_the_table_has_one_registered(step):
    # tests/ops/test_backward.py checks each of them against autograd through the reference.
    registered = torch._C._dispatch_has_kernel_for_dispatch_key(f"{ops.NAMESPACE}::{step.name}", "Autograd")
    assert registered == (step.backward is not None), step.name


@pytest.mark.parametrize("step", [s for s in steps.STEPS if s.schema], ids=lambda step: step.name)
def test_every_op_has_its_schema_and_a_fake_kernel(step):
    qualified = f"{ops.NAMESPACE}::{step.name}"
    assert simple_registry.singleton.find(qualified).fake_impl.kernel is not None, f"no fake for {qualified}"
    schema = str(getattr(torch.ops.bert_cluster, step.name).default._schema)
    assert schema_arguments(schema[schema.index("(") :]) == schema_arguments(step.schema)
    assert callable(getattr(ops, step.name)), f"ops.{step.name}: the typed wrapper"


def test_every_op_of_the_namespace_is_a_step():
    ops.load_kernels()
    prefix = f"{ops.NAMESPACE}::"
    names = {name[len(prefix) :] for name in torch._C._dispatch_get_all_op_names() if name.startswith(prefix)}
    assert names - WHOLE_CALL_OPS == {step.name for step in steps.STEPS if step.schema}


@pytest.mark.parametrize(
    ("backend", "key"),
    [pytest.param("cpu", "CPU", id="cpu"), pytest.param("cuda", "CUDA", id="cuda", marks=pytest.mark.cuda)],
)
def test_each_backend_registers_a_kernel_for_exactly_the_steps_it_claims(backend, key):
    state = ops.load_kernels()
    if key == "CPU" and not state["loaded"]:
        pytest.skip(f"no compiled kernels: {state['reason']}")
    if key == "CUDA":
        dispatch.CudaKernelBackend.is_available()  # builds them on first use where _C has none
        if not any(_loader.has_kernel(step.name, "CUDA") for step in steps.STEPS if step.schema):
            pytest.skip("no CUDA kernels registered here")
    registered = {step.name for step in steps.STEPS if step.schema and _loader.has_kernel(step.name, key)}
    claimed = set(steps.compiled_by(backend)) - ops.PENDING_KERNELS
    assert registered == claimed


@pytest.mark.parametrize("name", list(dispatch.BACKENDS))
def test_each_backend_gets_its_steps_from_the_table(name):
    backend = dispatch.BACKENDS[name]
    for step in steps.STEPS:
        implementation = getattr(backend, step.name)
        if name in step.compiled:
            assert implementation.__module__ == dispatch.__name__ and implementation.__name__ == step.name
        elif step.fused:
            assert implementation is None, f"{name} has the fused {step.name} without compiling it"
        else:
            assert implementation is step.reference_function(), f"{name}.{step.name}"
