"""The fleet simulator: real scheduler, cost-model runner, real tuner, simulated time."""
