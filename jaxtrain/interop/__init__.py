"""What consumes or feeds the trainer from outside: Hugging Face safetensors out of a run and into a
new one (``hf``, its file layouts in ``hf_files``) and the MLflow model-registry hand-off (``registry``)."""
