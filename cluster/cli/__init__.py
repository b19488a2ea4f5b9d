"""The ``duet`` command line: :mod:`~cluster.cli.main` (parser and dispatch; ``python -m cluster.cli``), one module
per subcommand (:mod:`~cluster.cli.generate_cmd`, :mod:`~cluster.cli.plan_cmd`, :mod:`~cluster.cli.status_cmd`,
:mod:`~cluster.cli.bench_cmd`; ``duet serve`` is :mod:`cluster.serve.cli`)."""
