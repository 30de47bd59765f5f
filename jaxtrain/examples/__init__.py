"""Worked examples of the generic trainer (``jaxtrain.fit`` with a ModelSpec)."""
