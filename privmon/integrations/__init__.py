"""privmon."""
