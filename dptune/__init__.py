"""dptune package."""
