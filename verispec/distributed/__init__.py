"""Tensor parallelism: one process per rank on torch.distributed, weights sharded Megatron-style (`shard.py`), the
collectives of a forward on a shared-memory channel where ranks share a machine (`group.py`)."""
