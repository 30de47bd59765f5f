"""Job submission for multi-process training: ``python -m jaxtrain.launch gke|vertex|slurm|ray|kubeflow|volcano``.

Each target writes a spec whose every process runs ``python -m jaxtrain.train --config FILE
key=value ...`` and tells jaxtrain how to start ``jax.distributed`` (the job table of
``jaxtrain.runtime.job``): a GKE JobSet (``gke``), a Vertex AI CustomJob (``vertex``), an sbatch
script whose tasks start under ``srun`` (``slurm``), a Ray Train run (``ray``), a Kubeflow Trainer
TrainJob (``kubeflow``) or a Volcano Job (``volcano``). ``--dry-run`` prints the spec instead of
submitting it.
"""
from jaxtrain.errors import LaunchError, SubmitError
from jaxtrain.launch.common import Job, main

__all__ = ["Job", "LaunchError", "SubmitError", "main"]
