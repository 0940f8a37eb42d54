"""Pass 3, batch_dim: where is the batch dimension at every node, and which ops move it or mix samples."""
from fxdp.diagnostics import PassReport, PassResult


def propagate_batch_dim(gm, example_inputs, *, batch_dim: int = 0, strict: bool = False) -> PassResult:
    raise NotImplementedError("batch_dim pass: being written")


def find_batch_dim_violations(model, example_inputs, batch_dim: int = 0):
    raise NotImplementedError("batch_dim pass: being written")
