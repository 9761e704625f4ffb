"""dataplane package."""
