"""portapipe: DeepSeek-style pipeline and expert parallelism for MoE training on any accelerator."""

__version__ = "0.1.0"
