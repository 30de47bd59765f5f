"""Command lines: ``python -m jaxtrain.<cmd>`` or the ``jaxtrain-<cmd>`` console scripts.

Each command parses its arguments here and calls the library; ``common.cli`` turns
every named error into ``error: <key>: ...`` and its exit code.
"""
