"""The one device mesh (``mesh``), rule sets mapping logical names to mesh axes (``rules``) and the
activation constraints model code uses by logical name (``activations``)."""
