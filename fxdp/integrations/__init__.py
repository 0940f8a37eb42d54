"""Optional integrations with other libraries; each module imports its library, so import it only when you use it.

``fxdp.integrations.transformers``  Hugging Face ``Trainer`` trained with DP-SGD (extra ``transformers``)
``fxdp.integrations.lightning``     PyTorch Lightning: ``DPCallback`` (extra ``lightning``)
``fxdp.integrations.accelerate``    Hugging Face Accelerate: ``make_private`` in the order DP-SGD needs (``accelerate``)

docs/integrations.md describes the three.
"""
