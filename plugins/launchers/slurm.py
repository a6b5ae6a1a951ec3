"""The ``slurm`` launcher (being written)."""
