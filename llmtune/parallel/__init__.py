"""The parallel dimensions a run is split along: `engines` (data parallelism: DDP, FSDP2, DeepSpeed ZeRO; each
engine's micro-step, backward, clipping, optimizer step and sharded checkpoint) and `sequence` (rows split along the
sequence, Ulysses attention: the sequence group and its all-to-alls). The data x sequence processes form one mesh
(`sequence.mesh_group`)."""
