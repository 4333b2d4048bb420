"""Pure-Python engine core: request state, paged KV block manager, scheduler and policies.

Nothing here imports torch: the same scheduler runs in the real engine and the fleet simulator.
"""
