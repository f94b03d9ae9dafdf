"""Online trainer: tails the trajectory buffer and distils the target into the drafter."""
