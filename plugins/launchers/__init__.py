"""The built-in launchers, side by side: ``local`` (the processes of a run on this host,
``--nproc N``), ``ray`` (learner ranks and rollout servers placed on a Ray cluster) and
``slurm`` (the ranks started by ``srun`` inside an allocation, or an ``sbatch`` script
submitted). ``ray`` and ``slurm`` read the same placement plan (:mod:`.placement`), a pure
function from the run and the launcher's options to roles, bundles and each rank's variables.
"""
