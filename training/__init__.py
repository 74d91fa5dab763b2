"""Scripts that build specserve's built-in default target/draft model pair (see training/README.md)."""
