"""attn2's launch and compile only (no attn2_splits, no attn2_workspace_bytes)."""

from musebench.cute_ops import launch_attn2, prepare_attn2  # noqa: F401
