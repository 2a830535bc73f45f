"""GPU benchmarks behind `qfuse bench <name>`: each writes <name>.json and <name>.png."""
