"""The kernel families the one driver runs, by name: each module implements the Case protocol
(`musebench.harness.case`). Adding a family is its kernels, one module here and its line below,
and the CLI command that names it."""

from __future__ import annotations

from musebench.cases import ep_tail, routing, tp_tail
from musebench.cases import qkv_front

FAMILIES = {ep_tail.name: ep_tail, tp_tail.name: tp_tail, routing.name: routing}
FAMILIES[qkv_front.name] = qkv_front  # the QKV front (`musebench front`)
from musebench.cases import attn2  # noqa: E402

FAMILIES[attn2.name] = attn2  # attn2 (`musebench attn`)
