"""One replica of a stage: its compute and its state. The compute (`runtime`: forward, backward,
the optimizer update) with the activations it keeps (`activation_cache`), the step's sums and
receipts (`step_sums`, `accumulate`), the parameters a step computes on (`delayed_copies`); its
round, one strategy per rule (`no_round`, `local_round`, `eager_round`); its part of the commit
(`commit`); its state served and taken (`snapshot`, `state_transfer`, `copying`, `following`,
`update_log`); what it accepts and answers (`tensor_checks`, `messages`); the push plane at it
(`push`, `next_hop`); where its torch work runs (`worker`; timed and copied through
`swarm.device`)."""
