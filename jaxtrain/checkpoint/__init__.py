"""Checkpoints: Orbax saves with commit markers and retention (``checkpointer``), where they are
stored (``storage``: local, GCS, S3), and Hugging Face safetensors out and in (``hf``)."""
