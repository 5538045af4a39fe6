"""The TP finalize's host dispatch: which path the stock takes for m tokens on tp ranks of nsm SMs.

Both sides of the TP contract read it: the bitwise reference (`musebench.stock.tp`), which
computes the path's arithmetic, and the TP tail kernel (`musebench.kernels.tp_tail`), which
compiles one variant per path. It is plain Python at the config level (no torch, no CuTe), so
neither side imports the other. The rule and its sources are in `musebench.stock.tp`'s docstring
(FlashInfer 0.7.2.post1 `comm/tp_moe_finalize_rmsnorm.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

H_DIM = 4096
K_EXPERTS = 8
MAX_SPLIT = 16
PEER_BATCH_VECS = 32
NSLOT = 256  # the stock refuses a device with more SMs than this

EXPERT_OWNER = "expert-owner"
TOKEN_OWNER = "token-owner"  # single cooperative launch
TOKEN_OWNER_CHUNKED = "token-owner-chunked"  # stage / owner / copy launches
EXTENSION = "extension"
EMPTY = "empty"

_STOCK_NAMES = (EXPERT_OWNER, TOKEN_OWNER, TOKEN_OWNER_CHUNKED)
_SPLITS = (1, 2, 4, 8, 16)


def stock_supports_tp(tp: int) -> bool:
    """Whether the stock initializes for a TP group of this size (P > 1 and P divides 8)."""
    return tp > 1 and K_EXPERTS % tp == 0


def _pick_split(n: int, nsm: int) -> int:
    s = 1
    while s < MAX_SPLIT and n * s * 2 <= nsm:
        s *= 2
    return s


def _peer_batch(tp: int) -> int:
    return max(1, min(K_EXPERTS, PEER_BATCH_VECS // max(1, tp - 1)))


def token_crossover(tp: int) -> int:
    """Smallest token count the stock sends to a token-owner path."""
    return max(1, 64 // tp)


def single_launch_ctas(m: int, tp: int) -> int:
    """Token-sized CTAs of the single launch: m padded up to whole slots of tp tokens."""
    return -(-m // tp) * tp


def _check_args(m: int, tp: int, nsm: int) -> None:
    if m < 0:
        raise ValueError(f"token count must be >= 0, got {m}")
    if tp < 2:
        raise ValueError(f"the TP tail needs tp >= 2, got {tp}")
    if not 1 <= nsm <= NSLOT:
        raise ValueError(f"nsm must be in 1..{NSLOT} (the stock refuses larger devices), got {nsm}")


@dataclass(frozen=True)
class TpStockPath:
    """One way the stock (or, for `extension`, this module) computes the TP tail.

    name: "expert-owner", "token-owner" (single launch), "token-owner-chunked", "extension"
          (no stock path) or "empty" (m = 0: the stock launches nothing).
    tp: the group size P.
    split: band split S (CTAs per token's row; fixes the sum-of-squares tree).
    owner_split: XP, CTAs sharing an owned token's routes on the single launch (1 or P); 1 on the
          chunked and extension paths; 0 where it has no meaning (expert-owner, empty).
    base: the stock layout whose arithmetic and delivery the path follows (== name for stock
          paths; "token-owner" or "token-owner-chunked" for an extension).
    fallback: the chunked path was taken because the preferred cooperative grid did not fit.
    """

    name: str
    tp: int
    split: int
    owner_split: int = 0
    base: str = ""
    fallback: bool = False

    def __post_init__(self) -> None:
        if not self.base:
            object.__setattr__(self, "base", self.name)
        if self.name not in (*_STOCK_NAMES, EXTENSION, EMPTY):
            raise ValueError(f"unknown TP path {self.name!r}")
        if self.tp < 2:
            raise ValueError(f"tp must be >= 2, got {self.tp}")
        if self.name == EMPTY:
            return
        if self.split not in _SPLITS:
            raise ValueError(f"split must be one of {_SPLITS}, got {self.split}")
        if self.name in _STOCK_NAMES:
            if self.base != self.name:
                raise ValueError("a stock path is its own base")
            if not stock_supports_tp(self.tp):
                raise ValueError(f"the stock has no path for tp={self.tp} (needs tp | {K_EXPERTS}); use the extension")
        else:
            if self.base not in (TOKEN_OWNER, TOKEN_OWNER_CHUNKED):
                raise ValueError(f"an extension follows a token-owner layout, not {self.base!r}")
        if self.base == TOKEN_OWNER:
            allowed = (1,) if self.name == EXTENSION else (1, self.tp)
            if self.owner_split not in allowed:
                raise ValueError(f"owner_split must be one of {allowed} here, got {self.owner_split}")
        elif self.base == TOKEN_OWNER_CHUNKED:
            if self.split != 1 or self.owner_split != 1:
                raise ValueError("the chunked token-owner path runs with S = 1 and XP = 1")
        elif self.owner_split != 0:
            raise ValueError("the expert-owner path has no owner split")

    @property
    def stock(self) -> bool:
        """Whether the stock itself can take this path (False for the extension)."""
        return self.name in _STOCK_NAMES or self.name == EMPTY

    @property
    def experts_per_owner(self) -> int:
        """KO: routes each rank owns on the expert-owner path (8 on token-owner paths)."""
        return K_EXPERTS // self.tp if self.base == EXPERT_OWNER else K_EXPERTS

    @property
    def combine(self) -> str:
        """'owner-partials', 'fma-chain' or 'rounded-products' (see the module docstring)."""
        if self.base == EXPERT_OWNER:
            return "owner-partials"
        if self.base == TOKEN_OWNER and self.owner_split > 1:
            return "rounded-products"
        return "fma-chain"

    @property
    def scrubbed_copies(self) -> bool:
        """Whether non-owner ranks receive each row through a sentinel-scrubbed copy."""
        return self.base == TOKEN_OWNER

    def describe(self) -> str:
        if self.name == EMPTY:
            return "empty (m=0: the stock launches nothing)"
        if self.name == EXPERT_OWNER:
            return f"expert-owner S={self.split} KO={self.experts_per_owner}"
        if self.name == TOKEN_OWNER:
            return f"token-owner S={self.split} XP={self.owner_split}"
        if self.name == TOKEN_OWNER_CHUNKED:
            return f"token-owner-chunked S={self.split}" + (" (fallback: cooperative grid did not fit)" if self.fallback else "")
        return f"extension S={self.split} XP=1 (no stock path; extension: {self.base} arithmetic at tp={self.tp})"


def tp_stock_path(m: int, tp: int, nsm: int, *, grid_fits: bool = True) -> TpStockPath:
    """The path the stock's host code picks for m tokens on a group of tp ranks (min SM count nsm).

    grid_fits=False models the stock's runtime fallback when the expert-owner or single-launch
    cooperative grid fails its occupancy check (all ranks then take the chunked path, S = 1).
    For tp not dividing 8 the result is the extension (see the module docstring).
    """
    _check_args(m, tp, nsm)
    if m == 0:
        return TpStockPath(EMPTY, tp, 0)
    padded = single_launch_ctas(m, tp)
    if not stock_supports_tp(tp):
        if padded <= nsm and grid_fits:
            return TpStockPath(EXTENSION, tp, _pick_split(padded, nsm), 1, base=TOKEN_OWNER)
        return TpStockPath(EXTENSION, tp, 1, 1, base=TOKEN_OWNER_CHUNKED, fallback=padded <= nsm)
    if m < token_crossover(tp):
        if grid_fits:
            return TpStockPath(EXPERT_OWNER, tp, _pick_split(m, nsm))
        return TpStockPath(TOKEN_OWNER_CHUNKED, tp, 1, 1, fallback=True)
    if padded > nsm:
        return TpStockPath(TOKEN_OWNER_CHUNKED, tp, 1, 1)
    if not grid_fits:
        return TpStockPath(TOKEN_OWNER_CHUNKED, tp, 1, 1, fallback=True)
    xp = 1 if _peer_batch(tp) == K_EXPERTS and m <= 12 * tp else tp
    return TpStockPath(TOKEN_OWNER, tp, _pick_split(padded, nsm), xp)


def tp_split(m: int, tp: int, nsm: int) -> int:
    """Band split S the stock picks (the sum-of-squares tree shape); see `tp_stock_path`."""
    return tp_stock_path(m, tp, nsm).split
