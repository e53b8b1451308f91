"""The runtime service: agent turns."""
