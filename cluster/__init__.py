"""The control plane, the only package that knows both worker kinds. Sub-packages by concern:

* :mod:`cluster.control` -- cluster spec, the disaggregated cluster (actors, request flow, retries), request
  placement, pool healing, autoscaling decisions, the in-process pair;
* :mod:`cluster.serve` -- the gRPC (``duet.v1``) and OpenAI-compatible HTTP front-end, limits, metrics;
* :mod:`cluster.experts` -- expert placement, the expert router of each decode group, the expert-cache simulation;
* :mod:`cluster.planner` -- pool sizing by simulation (``duet plan``);
* :mod:`cluster.cli` -- the ``duet`` command line;
* :mod:`duet_bench` -- benchmarks (``duet bench ...``), which runtime code never imports;
* :mod:`cluster.demo` -- the shipped demo model and its task generator; :mod:`cluster.report` -- table / JSON output.
"""
