"""The table of the paper's steps (``bert_cluster.steps``) against what is registered and dispatched.

Every op is declared by its step's reference function (its schema is the function's signature), has a fake
kernel, and each backend that the table says compiles a step has its kernel registered in ``torch.ops``
(and no other backend has one): the table cannot drift from the kernels, ``ops.py`` or ``dispatch.py``.
The mode table names what each mode computes.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torch._library import simple_registry

from bert_cluster import _loader, config, dispatch, ops, steps

#: The Python ops that wrap a whole clustered_attention call and its backward for torch.compile
#: (attention.py): not steps.
WHOLE_CALL_OPS = {"clustered_attention", "clustered_attention_backward"}


def op_schema(name: str) -> torch.FunctionSchema:
    """The schema ``torch.ops.bert_cluster.<name>`` was defined with."""
    return getattr(torch.ops.bert_cluster, name).default._schema


def op_arguments(name: str) -> list[str]:
    return [argument.name for argument in op_schema(name).arguments]


@pytest.mark.parametrize("step", steps.STEPS, ids=lambda step: step.name)
def test_every_step_has_a_reference_with_the_ops_arguments(step):
    function = step.reference_function()
    assert callable(function), step.reference
    if step.op:
        # The op's arguments, in order, with the reference's defaults (attention dropout in training).
        parameters = inspect.signature(function).parameters.values()
        assert [p.name for p in parameters] == op_arguments(step.name)
        defaults = {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}
        schema = op_schema(step.name)
        assert {a.name: a.default_value for a in schema.arguments if a.has_default_value()} == defaults
    assert set(step.compiled) <= set(steps.KERNEL_BACKENDS)
    if step.backward not in (None, steps.AUTOGRAD):  # a backward op: a step of the table, from the
        assert steps.BY_NAME[step.backward].op  # gradients of the op's outputs
        first = op_schema(step.backward).arguments[0]
        assert first.name.startswith("grad_") and str(first.type) == "Tensor", step.backward


@pytest.mark.parametrize("step", [s for s in steps.STEPS if s.op], ids=lambda step: step.name)
def test_a_step_with_a_backward_in_the_table_has_one_registered(step):
    # tests/ops/test_backward.py checks each of them against autograd through the reference.
    registered = torch._C._dispatch_has_kernel_for_dispatch_key(f"{ops.NAMESPACE}::{step.name}", "Autograd")
    assert registered == (step.backward is not None), step.name


@pytest.mark.parametrize("step", [s for s in steps.STEPS if s.op], ids=lambda step: step.name)
def test_every_op_is_declared_once_with_a_fake_kernel(step):
    """The typed wrapper ``ops.<name>`` is the op's declaration: the reference function's signature."""
    qualified = f"{ops.NAMESPACE}::{step.name}"
    assert simple_registry.singleton.find(qualified).fake_impl.kernel is not None, f"no fake for {qualified}"
    wrapper = getattr(ops, step.name)
    assert isinstance(wrapper, ops.Op)
    assert wrapper.overload is getattr(torch.ops.bert_cluster, step.name).default
    assert inspect.signature(wrapper) == inspect.signature(step.reference_function())


def test_dropout_is_an_argument_of_the_ops_that_drop():
    """No op mirrors another with dropout: the ops that drop attention weights take it as arguments."""
    every_op = [step.name for step in steps.STEPS if step.op]
    assert not [name for name in every_op if "dropout" in name]
    dropping = {name for name in every_op if "dropout" in op_arguments(name)}
    refinements = {"topk_refine", "refine_with_query_mass", "banded_attention", "centroid_rest"}
    assert dropping == refinements | {f"{name}_backward" for name in refinements}


def test_every_op_of_the_namespace_is_a_step():
    ops.load_kernels()
    prefix = f"{ops.NAMESPACE}::"
    names = {name[len(prefix) :] for name in torch._C._dispatch_get_all_op_names() if name.startswith(prefix)}
    assert names - WHOLE_CALL_OPS == {step.name for step in steps.STEPS if step.op}


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
        if not any(_loader.has_kernel(step.name, "CUDA") for step in steps.STEPS if step.op):
            pytest.skip("no CUDA kernels registered here")
    registered = {step.name for step in steps.STEPS if step.op and _loader.has_kernel(step.name, key)}
    claimed = set(steps.compiled_by(backend)) - ops.PENDING_KERNELS
    assert registered == claimed


@pytest.mark.parametrize("name", list(dispatch.BACKENDS))
def test_each_backend_gets_its_steps_from_the_table(name):
    backend = dispatch.BACKENDS[name]
    for step in steps.STEPS:
        implementation = getattr(backend, step.name)
        if name in step.compiled:
            assert implementation is getattr(ops, step.name), f"{name}.{step.name}"
        elif step.fused:
            assert implementation is None, f"{name} has the fused {step.name} without compiling it"
        else:
            assert implementation is step.reference_function(), f"{name}.{step.name}"


def test_the_mode_table_names_every_mode_a_config_accepts():
    assert tuple(steps.MODES) == config.MODES
    for name, mode in steps.MODES.items():
        assert mode.name == name
        assert steps.BY_NAME[mode.refinement].op, mode
        assert mode.uses_topk or not mode.query_mass, f"{name}: a query's own mass needs the top-k keys"
    assert steps.MODES["clustered"].refinement == "broadcast_clusters"
    assert steps.MODES["i-clustered"].refinement == "topk_refine"
    assert steps.MODES["i-clustered+"].refinement == "refine_with_query_mass"
    assert [name for name, mode in steps.MODES.items() if mode.lloyd] == ["i-clustered+"]
