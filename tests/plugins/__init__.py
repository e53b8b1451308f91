"""Test plugins, loaded by runtimes started with PYTHONPATH=<repo>/tests."""
