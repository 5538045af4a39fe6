"""An implementation that is wrong on one rank: musebench's tails, with one bit of rank 1's
output flipped after every call. `--impl tests.impls.flip_rank1` must fail, naming rank 1."""

from musebench.kernels import routing  # noqa: F401
from tests.impls.flip_rank1 import tail  # noqa: F401
