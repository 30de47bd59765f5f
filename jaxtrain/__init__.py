"""jaxtrain: a JAX/XLA trainer with logical-axis sharding rules.

The public API, imported on first use (so ``import jaxtrain`` stays cheap):
``jaxtrain.fit(cfg, spec, data)`` trains any Flax NNX model (``jaxtrain.ModelSpec``) on
the config's mesh and rules; ``jaxtrain.load_config(file, overrides)`` reads a config;
``jaxtrain.ArrayData`` holds in-memory examples; ``jaxtrain.setup`` is the one run setup.
"""

__version__ = "0.1.0"

_API = {"fit": ("jaxtrain.train.trainer", "fit"), "setup": ("jaxtrain.train.assembly", "setup"),
        "ModelSpec": ("jaxtrain.train.model_spec", "ModelSpec"), "ArrayData": ("jaxtrain.data.arrays", "ArrayData"),
        "load_config": ("jaxtrain.config.loading", "load")}


def _models_from_checkout() -> None:
    """Imported from a source checkout, ``jaxtrain.models`` (and the other folders pyproject maps into
    the package) are that checkout's: also without installation (a GPU machine with no network),
    and also when an editable install of another checkout is on the path (its finder runs after
    the path search this extends). An installed package has no pyproject.toml beside it."""
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.isfile(os.path.join(root, "models", "__init__.py")) and os.path.isfile(
            os.path.join(root, "pyproject.toml")) and root not in __path__:  # noqa: F821
        __path__.append(root)  # noqa: F821 - the package's own search path


_models_from_checkout()


def __getattr__(name: str):
    if name in _API:
        import importlib
        module, attr = _API[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'jaxtrain' has no attribute '{name}'")
