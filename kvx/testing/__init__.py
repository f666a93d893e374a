"""Test support for kvx: conformance suites and fixtures (a pytest plugin)."""
