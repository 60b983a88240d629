"""The ``uccl-ep`` command line: bench, doctor and config."""
