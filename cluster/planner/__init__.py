"""Pool sizing by simulation: :mod:`~cluster.planner.planner` searches pool sizes and modes over the simulators of
:mod:`~cluster.planner.plan_model`; ``duet plan`` (:mod:`cluster.cli.plan_cmd`) prints the result."""
