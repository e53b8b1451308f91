"""Shared platform library of the Parley services: settings, NATS, Postgres, gRPC, metrics, logs."""
