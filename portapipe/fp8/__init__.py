"""DeepSeek-V3's FP8 training recipe (arXiv 2412.19437, 3.3 and appendix B), written once.

- :mod:`.quantize`: E4M3 values with power-of-two (UE8M0) scales, 1x128 tiles and 128x128 blocks,
  saturated before the cast;
- :mod:`.gemm`: the three GEMMs of a Linear (forward, input gradient, weight gradient), each with
  the tiles the report gives it, through the backend's FP8 matmul;
- :mod:`.saved`: what an FP8 Linear keeps of its input for the weight gradient (under
  ``memory.fp8_activations``: the forward's FP8 rows, or nothing where the backward remakes it);
- :mod:`.dispatch`: the routed experts' rows in FP8 on the wire (dispatch and the gradient back to
  the experts), the rest in the compute dtype.

The FP8 matmul itself is a backend operation (:meth:`portapipe.backends.base.Backend.fp8_mm`,
declared by ``capabilities.fp8_matmul``; the emulation in :mod:`portapipe.backends.fp8_mm` is the
reference semantics); which of a model's Linears run in FP8 is
:mod:`portapipe.models.fp8_layers`'. See docs/fp8.md.
"""
