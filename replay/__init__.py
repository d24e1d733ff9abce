"""replay package."""
