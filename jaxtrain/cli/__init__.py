"""The shared command-line plumbing (``common``: named errors to exit codes, config arguments) and the
commands of training (``train``) and export/import (``export``).

The analysis commands (``plan``, ``explain``, ``report``) and ``jaxtrain.data.prepare`` keep their
command line beside their code; every command is ``python -m jaxtrain.<cmd>`` and ``jaxtrain-<cmd>``.
"""
