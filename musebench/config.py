"""Muse Spark constants the decode kernels are specialized for.

Source: vllm 0.33.0, `vllm/transformers_utils/configs/muse_spark.py` (the config classes and their
defaults) and `vllm/models/muse_spark/nvidia/model.py` (how the MoE block reads them: the router
is built with sigmoid scores and `router_score_division_eps=1e-15`; the post-expert norm is
`MuseSpark1xRMSNormWithInputScale`, i.e. the weight applied before the norm, zero-centred gamma
with gain centre "one", eps `post_norm_eps`; the router output multiplier is folded into the
router weight at load by `fold_router_output_multiplier`, so the routing kernel never sees it).
The checkpoint-specific sizes (hidden 8192, pooled width 4096, 256 experts, top-8, 128/16 heads
of 64, window 2048) are the Muse Spark release's.
"""

from __future__ import annotations

HIDDEN_SIZE = 8192
MOE_POOLED_WIDTH = 4096  # pooler: hidden -> pooled width; the MoE tails work at this width
NUM_EXPERTS = 256
TOP_K = 8
NUM_QUERY_HEADS = 128
NUM_KV_HEADS = 16
HEAD_DIM = 64
SLIDING_WINDOW = 2048

RMS_NORM_EPS = 1e-5
POST_NORM_EPS = 1e-8  # the post-expert RMSNorm of the MoE tails
POST_NORM_GAIN_CENTER = 1.0  # gain_center_type "one" with zero-centred gamma: weight = gamma + 1
POST_NORM_WEIGHT_BEFORE_NORM = True  # MuseSpark1xRMSNormWithInputScale

ROUTER_SCORE_NORMALIZATION = "sigmoid"
ROUTER_SCORE_DIVISION_EPS = 1e-15
# routed_scaling_factor comes from the checkpoint; MoEArgs defaults it to 1.0. The kernels take it
# as a runtime argument, so the harness sweeps it (`--route-scale`) instead of baking one value.
ROUTE_SCALE_DEFAULT = 1.0
# output_multiplier is folded into the router weight at load (fold_router_output_multiplier):
# the routing kernels refuse an unfolded multiplier instead of applying it.
ROUTER_OUTPUT_MULTIPLIER_FOLDED = True

TP_SIZES = range(2, 33)  # the tails run at TP 2..32
MAX_DECODE_TOKENS = 8  # decode batch the kernels are tuned for (b = 1..8)

# --- attn2: the verify step's attention (issue 15) -------------------------------------------
# Source: vllm 0.33.0 `vllm/models/muse_spark/nvidia/model.py` (MuseSpark1xAttention): the
# softmax scale is `head_dim ** -0.5` multiplied (Python float64) by the checkpoint's
# `qk_scale_factor` on layers with QK-norm (every target layer); the o-norm is a weightless
# MuseSpark1xRMSNorm over head_dim with `rms_norm_eps`; the gate is sigmoid (rms_norm_gated's
# "sigmoid" activation). qk_scale_factor is a checkpoint value (the config class has no default).
QK_SCALE_FACTOR = 5.473
ATTN_SCALE = HEAD_DIM**-0.5 * QK_SCALE_FACTOR  # 0.684125, as the model computes it (float64)
KV_PAGE_TOKENS = 16  # tokens of one KV-cache page (vLLM's block size for this model)
VERIFY_QUERY_LEN = 8  # query rows of one request in the verify step: 1 + 7 draft tokens
