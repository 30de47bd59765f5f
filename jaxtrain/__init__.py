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


def __getattr__(name: str):
    if name in _API:
        import importlib
        module, attr = _API[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'jaxtrain' has no attribute '{name}'")
