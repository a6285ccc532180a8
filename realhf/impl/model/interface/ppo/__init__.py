"""PPO and its family (GRPO, Dr. GRPO, DAPO, GSPO, RLOO, REINFORCE++): the options
(:mod:`.ppo_config`, ``ppo.*``), the batch preparation that turns rewards into advantages
(:mod:`.ppo_data`), the actor's generate / inference / train_step (:mod:`.ppo_interface`)
and the critic (:mod:`.critic_interface`).  The maths are pure functions in
:mod:`realhf.impl.algorithms`."""
