"""Plugins: finding and checking them, an agent's catalog, and the built-in ones."""
