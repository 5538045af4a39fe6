"""musebench's own kernels, re-exported under the seeds' flat layout (`<module>.tail`,
`<module>.routing`): `--impl tests.impls.reexport` must pass wherever `--impl musebench` does."""

from musebench.kernels import routing, tail  # noqa: F401
