"""What train, bench, profile and plan share to measure and predict a model's step, below all of them.

    subject       the model `--model`, the size flags and `--set` describe
    model_flags   the flags bench and profile-memory share, and how a recipe, `--set` and they are read
    costs         per-layer seconds of one micro-batch, from the one per-layer measurer
    cost_cache    those costs measured at launch for `balance: auto`/`time`, cached per machine
    simulate      the step time of the engine's own action lists, from per-layer costs
    measure       timed training steps of the engine on the ranks, by one common clock, and whether the
                  machine was the job's alone meanwhile
"""
