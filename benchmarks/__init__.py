"""duplexpipe benchmarks: runtime vs torch.distributed.pipelining, simulator fidelity, overlap, tooling."""
