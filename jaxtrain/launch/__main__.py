"""``python -m jaxtrain.launch gke|vertex|slurm|ray|kubeflow|volcano --config FILE [key=value ...] [flags]``."""
import sys

from jaxtrain.launch.common import main

if __name__ == "__main__":
    sys.exit(main())
