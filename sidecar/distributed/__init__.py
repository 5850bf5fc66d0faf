"""Scale-out over mx.distributed: tensor or pipeline parallel, rank 0 the one sidecar endpoint."""
