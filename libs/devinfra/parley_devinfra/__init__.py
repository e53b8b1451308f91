"""Development infrastructure of Parley: embedded NATS and PostgreSQL for `make run` and the tests.

Not a dependency of any service: only the CLI (`parley run`, `parley infra`), the tests and the
benchmarks use it.
"""
