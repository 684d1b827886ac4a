"""The coordinator's judges (issue 55, 64, 66): trust beside the step protocol, not inside it.
Who is banned and when each member came (`standing`, the one filter every view of the members
goes through), the bans that act on a verdict (`bans`: one rollback, results resting on a liar
voided), and the checks that judge a round's answers in one ordered place (`round_checks`: the
sums' checksums `sum_checks` and who they convict `sum_liars`, the words of what was sent
`sent_words`, the norm bound `norm_bound`, the audited contributions `contributions` and their
disputed digests `digest_disputes`). The coordinator builds them and the commit asks them; they
never reach back into the commit or the rollback but through what they are given."""
