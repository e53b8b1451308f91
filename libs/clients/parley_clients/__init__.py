"""Clients of Parley's services for other services: the pairing gate and the prompt batcher."""
