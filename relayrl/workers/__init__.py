"""Role workers of RL: plain classes that own a model and expose batch methods; the same class runs in-process
(`dist.mode=local`) or as a Ray actor (`dist.mode=ray`), see relayrl/distributed/launch.py.

    policy.py     PolicyWorker: policy + optimizer + EMA + the colocated rollout engine and agent executor
    reference.py  ReferenceWorker: frozen reference log-probs (only when a KL term is on)
    critic.py     CriticWorker: value model, values + clipped value-loss update (only for gae)
    reward.py     RewardWorker: the reward source (task / reward_func file / remote RM / local RM / agent)
    base.py       SequenceBatch, Experience (the records passed between controller and workers), collate
    model_ops.py  packed forward passes: token log-probs / entropy (chunked) and critic values
    builders.py   construction (models, optimizers, engine, executor) and the per-micro-batch policy loss
"""
