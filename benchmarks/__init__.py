"""plait's benchmarks: plait and torch side by side (run ``python -m benchmarks.run -h``)."""
