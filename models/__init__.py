"""Flax NNX model families (installed as ``jaxtrain.models``): one folder per family, named in
``registry.py``. Model code names its dimensions logically and never mentions a mesh."""
