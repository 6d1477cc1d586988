"""Tensor parallelism over torch.distributed (gloo on CPU, NCCL on GPU).

``shard.py``: a rank's share of the model (its config and its cut of each checkpoint tensor);
``group.py``: the process groups, the collectives a step runs, and rank 0's commands to the
others; ``layers.py``: the modules that sum or gather across ranks; ``worker.py``: the loop a
rank other than 0 runs; ``launch.py``: rank 0 starting the others on this machine.

Rank 0 runs the engine (scheduler, block manager, sampler); before each model call it
broadcasts what the others need to make the same call (the step's token chunks, KV block
copies, the hidden rows to project to logits), and every rank then runs its share of the
forward with one all-reduce after each attention and MLP block.
"""
