"""selection package."""
