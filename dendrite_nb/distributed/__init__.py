"""Tensor parallelism: one engine's model split over several processes of one host, one per GPU (NCCL), or over
CPU processes (gloo), through torch.distributed. Rank 0 is the engine's own process and keeps the tree, the
scheduler, sampling and constraints; ranks 1..N-1 are workers that hold their shard of the weights and of the KV
heads and run their share of each forward.

    shard.py     Megatron-style split of a model's weights; which degrees a model takes
    spec.py      what every rank builds the whole model from (a checkpoint path, or a random config and seed)
    channels.py  the process groups (commands, host tensors, all-reduces) and their collectives, with timeouts
    group.py     rank 0's handle: spawning the workers, sending commands, failures, close()
    worker.py    a worker process: build, then do rank 0's commands
    pool.py      rank 0's KV pool, which mirrors block copies to the workers and gathers exported blocks
    launch.py    Engine.from_pretrained / from_random at tensor_parallel > 1: check, start, build

Each forward's plan input (the BatchLayout: lengths, block tables, tree segments; and the token ids) is built once
on rank 0 and sent as one pickled message; every rank plans the same attention backend over it for its own heads.
There is one all-reduce after attention's o_proj and one after the MLP's down_proj, per layer.
"""
