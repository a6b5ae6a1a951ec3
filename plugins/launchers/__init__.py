"""The built-in launchers, side by side: ``local.py`` (the processes of a run on this host,
``--nproc N``), ``ray.py`` (learner ranks and rollout servers placed on a Ray cluster) and
``slurm.py`` (the ranks started by ``srun`` inside an allocation, or an ``sbatch`` script
submitted). ``ray`` and ``slurm`` read the same placement plan (``placement.py``), a pure
function from the run and the launcher's options to roles, bundles and each rank's variables.
"""
