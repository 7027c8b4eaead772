"""Role workers of RL: plain classes that own a model and expose batch methods; the same class runs in-process
(`dist.mode=local`) or as a Ray actor (`dist.mode=ray`), see relayrl/distributed/launch/; the controller calls
them through typed handles by method reference (`policy.call(PolicyWorker.update, exp, kl_coef)`).

    policy.py     PolicyWorker(PolicySpec): TrainStep + PolicyObjective + EMA + the colocated engine and executor
    reference.py  ReferenceWorker(ReferenceSpec): frozen reference log-probs (only when a KL term is on)
    critic.py     CriticWorker(CriticSpec): value model, values + ValueObjective update (only for gae)
    reward.py     RewardWorker(RewardSpec): the reward source (task / reward_func file / remote / local RM / agent)
    base.py       SequenceBatch, Experience (the records passed between controller and workers), collate;
                  Rows (a record or its rows in Ray's object store) and each rank's rows of it
    model_ops.py  the forward (relayrl.models.forward) laid out as [B, T]: token log-probs / entropy, values
    builders.py   construction from component configs (models, objective, engine, executor)
    ema.py        PolicyEma: the policy's fp32 EMA, sharded like the policy on N ranks (DCP checkpoints)
    trained.py    what trained roles share (sharding, RoleState checkpoints); ModelWorker (one-model recipes)
    proxies.py    Protocols of roles more than one worker class fills (Generates, HoldsState); WorkerFolder

Workers import the training core (relayrl/training), never the recipes (relayrl/trainers).
"""
