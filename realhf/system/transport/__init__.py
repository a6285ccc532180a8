"""Moving bytes between processes: ZMQ request/reply and push/pull streams, the errors that
cross a process boundary, and the model workers' torch.distributed world."""
