"""Tensor and pipeline parallelism: one engine process, T x S model worker processes.

The engine process keeps everything but the model (scheduler, sampler, detokenizer, API) and
drives the workers through ``ParallelRunner`` (runner.py). Each worker (worker.py) holds one
pipeline stage's layers (layout.py), sharded over the stage's tensor-parallel ranks
(sharding.py), with its share of the paged KV cache. Steps travel over torch.distributed: gloo
on CPUs, where every test runs; NCCL for the tensors between GPUs.
"""
