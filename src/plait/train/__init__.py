"""The pieces of the ``plait`` training command (the model lives here so benchmarks share it)."""
