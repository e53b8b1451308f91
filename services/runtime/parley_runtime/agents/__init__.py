"""The agents a replica serves, with their catalogs kept current (plugins and custom actions)."""
