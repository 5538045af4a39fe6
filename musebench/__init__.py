"""musebench: bitwise parity and timing for Muse Spark's decode kernels."""

__version__ = "0.1.0"
