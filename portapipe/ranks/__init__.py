"""Starting, watching and stopping the ranks of a job.

- :mod:`.launch`: the entry point: local ranks, or the environment torchrun / mpirun made;
- :mod:`.local_job`: local rank processes, their records and the first cause of a failure;
- :mod:`.lifeline`: a rank ends when its launcher does;
- :mod:`.forkserver_tie`: the same for the forkserver that starts the ranks;
- :mod:`.pinning`: one disjoint set of cores per rank (``launch.pin_cores``);
- :mod:`.restart`: a failed local job started again (``launch.max_restarts``), and what is not retried;
- :mod:`.stop`: SIGINT / SIGTERM ask every rank to finish its step and stop;
- :mod:`.cpu_isa`: the CPU instruction sets a rank may use (a trap named, not a crash).
"""
