"""Running one model over several devices and hosts: the mesh and its axes (``mesh.py``), every
PartitionSpec of the weights, KV cache and step (``sharding.py``), the
experts' shard_map (``expert_parallel.py``), the multi-host collectives (``distributed.py``) and
the wire format of a step process 0 announces to the other processes (``step_broadcast.py``)."""
