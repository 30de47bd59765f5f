"""jaxtrain: a JAX/XLA trainer with logical-axis sharding rules."""

__version__ = "0.1.0"
