"""The shared command-line plumbing (``common``: named errors to exit codes, config arguments) and the
commands of training (``train``), export/import (``export``) and the token cache (``prepare``).

The analysis commands (``plan``, ``explain``, ``report``) keep their command line beside their code;
every command is ``python -m jaxtrain.<cmd>`` and ``jaxtrain-<cmd>``.
"""
