"""Workers."""
