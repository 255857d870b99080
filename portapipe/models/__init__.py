"""The models a stage runs: the portapipe, DeepSeek-V3 and Qwen3-MoE architectures built from
one set of parts (attention, RoPE, routing, the MoE layer and its expert-parallel exchange, FP8
Linears, the training objective), and Hugging Face weights in and out."""
