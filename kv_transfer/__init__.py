"""The KV wire: block codec, transports (torch.distributed, gRPC, in-process) and the transfer state machine.

Must not import the model. Filled in by the disaggregated serving issue.
"""
