"""Implementations under test for `--impl` tests: modules that provide the seeds' API."""
