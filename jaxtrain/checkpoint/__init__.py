"""Checkpoints: Orbax saves with commit markers (``checkpointer``: the save/commit/restore state
machine; ``pending``: the save in flight; ``restoring``: the checked read of a step), what the names
in a checkpoint directory mean (``layout``: markers, crash clean-up, set-aside steps, deletion), which
steps are kept (``retention``), file checks (``integrity``), many processes (``processes``) and where
they are stored (``storage``: local, GCS, S3). Hugging Face safetensors are ``jaxtrain.interop.hf``."""
