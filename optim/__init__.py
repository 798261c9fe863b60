"""Optimizers (ANVIL, NorMuon, Adam), their sharding across ranks, the schedule, tail averages."""
