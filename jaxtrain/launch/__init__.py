"""Job submission for multi-process training: ``python -m jaxtrain.launch gke|vertex|slurm``.

Each target writes a spec whose every process runs ``python -m jaxtrain.train --config FILE
key=value ...`` and tells jaxtrain how to start ``jax.distributed``: a GKE JobSet (``gke``), a
Vertex AI CustomJob (``vertex``) or an sbatch script whose tasks start under ``srun``
(``slurm``). ``--dry-run`` prints the spec instead of submitting it.
"""
from jaxtrain.errors import LaunchError, SubmitError
from jaxtrain.launch.common import Job, main

__all__ = ["Job", "LaunchError", "SubmitError", "main"]
