"""The parts of the GPU check (benchmarks/gpu_check.py, the driver): one module per part or family
of parts, :mod:`parts` their registry, :mod:`common` what they share (a part's record and
context, child processes, the CUDA questions asked without a CUDA context)."""
