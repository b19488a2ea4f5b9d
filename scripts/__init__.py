"""Developer scripts, not installed: stub generation (``gen_protos.py``), setup (``setup.sh``), demo training."""
