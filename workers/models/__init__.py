"""Model implementations; ``registry.model_class_for`` picks one for a checkpoint."""
