"""relayrl: post-training language models with reinforcement learning, from a laptop CPU to a Ray cluster.

The folder tree is the architecture (see docs/architecture.md):
config/ data/ models/ algorithms/ rollout/ agents/ trainers/ workers/ distributed/ tasks/ cli.py
"""

__version__ = "0.1.0"
