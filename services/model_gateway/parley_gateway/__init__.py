"""The model gateway: every model call of the suite goes through here."""
