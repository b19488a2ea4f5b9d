"""Control plane: CLI (``duet``), benchmarks, and (next) cluster builder, router, autoscaler, front-ends."""
