"""The ONE training core every trainer and worker uses (below workers/ and trainers/, above models/):

    optim.py        AdamW param groups (fused on CUDA) + warmup/decay schedules: build_optim
    step.py         TrainStep: micro-batch loop, (loss_sum, count) global normalisation, bf16 mixed precision
                    over fp32 master weights, clipping, non-finite guard; LossOutput / LossFn / StepOutput
    sampler.py      ResumableSampler: seeded per-epoch order, state {epoch, position}
    loop.py         Trainer: the fit loop of SFT-style recipes (step, eval, log, checkpoint, resume)
    checkpoint.py   atomic, rotating checkpoints (latest, best), exact resume
    rng.py          RNG capture / restore (python, numpy, torch, CUDA) and seeding
    logging.py      metrics.jsonl, console progress, TensorBoard, W&B
    setup.py        component configs -> the parts above (resolve_device, build_train_step, ...)

Recipes (trainers/) and role workers (workers/) import from here; nothing here imports them.
"""
