"""The repository's own tools (not part of the installed package): :mod:`.gpu_check`, the
``make gpu-check`` harness."""
