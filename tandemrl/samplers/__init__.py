"""samplers package."""
