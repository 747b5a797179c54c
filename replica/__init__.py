"""replica."""
