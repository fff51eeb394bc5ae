"""Low-level ops with hand-written backward passes, each next to the plain-autograd reference it must match."""
