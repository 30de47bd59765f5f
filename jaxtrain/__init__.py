"""jaxtrain: a JAX/XLA trainer with logical-axis sharding rules.

The public API, imported on first use (so ``import jaxtrain`` stays cheap):
``jaxtrain.fit(cfg, spec, data)`` trains any Flax NNX model (``jaxtrain.ModelSpec``) on
the config's mesh and rules; ``jaxtrain.load_config(file, overrides)`` reads a config;
``jaxtrain.ArrayData`` holds in-memory examples; ``jaxtrain.setup`` is the one run setup.
"""

__version__ = "0.1.0"

_API = {"fit": ("jaxtrain.train.fit", "fit"), "setup": ("jaxtrain.train.setup", "setup"),
        "ModelSpec": ("jaxtrain.train.spec", "ModelSpec"), "ArrayData": ("jaxtrain.data.arrays", "ArrayData"),
        "load_config": ("jaxtrain.config.loading", "load")}


def _models_from_checkout() -> None:
    """Run from a source checkout without installation (e.g. a GPU machine with no network):
    ``jaxtrain.models`` is then the checkout's ``models/`` (installed, pyproject maps it there)."""
    import importlib.util
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.isfile(os.path.join(root, "models", "__init__.py")) and importlib.util.find_spec(
            "jaxtrain.models") is None:
        __path__.append(root)  # noqa: F821 - the package's own search path


_models_from_checkout()


def __getattr__(name: str):
    if name in _API:
        import importlib
        module, attr = _API[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'jaxtrain' has no attribute '{name}'")
