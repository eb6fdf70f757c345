"""bert-cluster's benchmarks and measurement runs: one module each, run as ``python -m benchmarks.NAME``.

Each module measures one thing (``attention``: one call against torch's SDPA; ``long_context``: whole
models on long documents; ``peers``: against ONNX Runtime and OpenVINO; ...) and writes a results file;
``harness`` holds what they share (timing rounds, the load average, the environment a run records,
memory probes, the long documents); ``render`` turns the results files under docs/results/ into the
tables of the README and docs/, as ``registry.yaml`` lists them. The modules import only the package's
public names. Not part of the wheel: run them from a checkout.
"""
