"""What a run calls off the clock: the node's preflight, the host-sync check, the collective-order
check, and the step's cost counted on `meta` (its FLOPs give the logged MFU). Nothing on the clock
runs this code, except the sync check's guard when SPEEDRUN_SYNC_CHECK=1 asks for it."""
