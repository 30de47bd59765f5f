"""Checkpoints: Orbax saves with commit markers and retention (``checkpointer``) and where they are
stored (``storage``: local, GCS, S3). Hugging Face safetensors are ``jaxtrain.train.hf``."""
